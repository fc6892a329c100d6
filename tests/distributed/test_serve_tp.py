"""`pagedllm serve -tp 2`: the engine core starts a worker per rank, answers like one process, and a killed
worker turns /health to 503 within 10 s with every process of the engine gone."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))
from serve_helpers import Server, make_model  # noqa: E402

pytestmark = pytest.mark.slow  # two server start-ups, each with its workers


def _completion(server: Server, prompt: list[int]) -> list[int]:
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": server.args[4], "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "logprobs": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_serve_tp2_matches_tp1_and_a_dead_worker_fails_it_fast(tmp_path):
    model = make_model("qwen3", tmp_path / "model")
    prompt = [100, 2000, 3000, 4000, 5000]
    one = Server("tp1", model, [], tmp_path).wait_ready()
    try:
        expected = _completion(one, prompt)
    finally:
        one.stop()
    server = Server("tp2", model, ["-tp", "2"], tmp_path).wait_ready()
    try:
        assert _completion(server, prompt) == expected
        core = psutil.Process(server.core_pid())
        workers = [p for p in core.children() if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(workers) == 2
        engine = [core, *workers]
        os.kill(workers[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 503:
                    break
            except httpx.HTTPError:
                break  # the server already exited, as it does when its engine dies
            time.sleep(0.1)
        else:
            pytest.fail(f"/health still answers 200 10 s after a worker died:\n{server.log_tail()}")
        psutil.wait_procs(engine, timeout=10)
        assert not [p.pid for p in engine if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert "worker rank 1 failed" in server.log_tail(20000)
    finally:
        server.stop()
