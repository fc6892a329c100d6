"""Helpers of the server tests: tiny models with real tokenizers, a `pagedllm serve` subprocess on
127.0.0.1 (free port, waits for /health), and an SSE parser.

conftest.py launches three servers together the first time any is needed, so start-ups overlap:
- "completions": a tiny Llama with the Mistral tokenizer's 32000-token vocabulary, an API key,
  --max-n 8 and small body/header limits;
- "chat": a tiny (tied) Llama with the Qwen3 tokenizer and its chat template, at most 2 running
  and 2 waiting requests (for the 429 test); the engine-failure test kills its engine core, and
  the server is started again if a later test asks for it (Server.wait_ready);
- "limits": the same model with 1-second header, body and keep-alive timeouts and at most 4
  connections (--limit-concurrency 4).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-pagedllm-test-key"
ENV_API_KEY = "sk-pagedllm-env-key"  # the completions server's PAGEDLLM_API_KEY
STARTUP_TIMEOUT_S = 240.0


def make_model(tok_name: str, path: Path, tie: bool = False) -> str:
    """A tiny random Llama whose vocabulary matches the real tokenizer `tok_name` (files copied in)."""
    from assets import tokenizer_dir
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tdir = tokenizer_dir(tok_name)
    tok = AutoTokenizer.from_pretrained(tdir)
    config = tiny_config("llama")
    config.vocab_size = len(tok)
    config.tie_word_embeddings = tie
    config.bos_token_id, config.eos_token_id, config.pad_token_id = tok.bos_token_id, tok.eos_token_id, None
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    for f in tdir.iterdir():
        shutil.copy(f, path)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(
        self, name: str, model: str, extra_args: list[str], log_dir: Path, api_key: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.extra_env = dict(env or {})
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_dir / f"{name}.log"
        self.args = [
            sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", model,
            "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--dtype", "float32",
            "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 << 20), "--disable-access-log",
            *extra_args,
        ]
        if api_key:
            self.args += ["--api-key", api_key]
        self.needs_restart = False
        self._log = None
        self._start()

    def _start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.extra_env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        if self._log is not None:
            self._log.close()
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
        self._ready = False

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_ready(self) -> Server:
        if self.needs_restart:
            self.needs_restart = False
            self.stop()
            self._start()
        if self._ready:
            return self
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self._ready = True
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        pytest.fail(f"server {self.name} not ready after {STARTUP_TIMEOUT_S} s:\n{self.log_tail()}")

    def core_pid(self) -> int:
        """The engine-core child process (a multiprocessing spawn child, not the resource tracker).

        Found by parent pid in /proc/*/stat, which names the parent process whichever of its
        threads started the child (the per-thread `children` lists miss those of exited threads).
        """
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:  # the process ended while we looked
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid and b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                return int(entry.name)
        raise AssertionError(f"no live engine-core child of {self.proc.pid}:\n{self.log_tail()}")

    def children(self) -> list[int]:
        """Pids of the live child processes of the server (the engine core among them)."""
        out = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                    out.append(int(entry.name))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def sse_events(lines) -> list:
    """Parsed `data:` payloads of an SSE stream (strings for non-JSON ones like [DONE])."""
    import json

    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
