"""A `pagedllm serve` process for benchmarks: started in its own session on loopback, stopped as a group."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = ["-m", "pagedllm.entrypoints.cli.main"]


def child_env() -> dict:
    """This process's environment (PYTHONPATH included), with the repo importable and the hub offline."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO not in [os.path.abspath(p) for p in paths]:
        paths.append(REPO)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""



def group_alive(pgid: int) -> bool:
    """Whether any process of the process group is still there."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True

class Server:
    """``pagedllm serve`` with ``serve_flags`` (model and engine flags) on a free loopback port; its output
    goes to ``log_path`` (or nowhere)."""

    def __init__(self, serve_flags: list[str], log_path: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or os.devnull
        self.cmd = [sys.executable, *CLI, "serve", "--host", "127.0.0.1", "--port", str(self.port), *serve_flags]
        self.log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=child_env(), start_new_session=True)
        self.pgid = self.proc.pid  # start_new_session: the server leads its own process group

    def wait_healthy(self, timeout: float) -> float:
        import httpx

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}) during start-up:\n{tail(self.log_path)}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not healthy after {timeout:.0f} s:\n{tail(self.log_path)}")

    def _group_alive(self) -> bool:
        return group_alive(self.pgid)

    def stop(self, timeout: float = 60.0) -> float:
        """SIGTERM to the whole group (front end and engine core), SIGKILL what is left after `timeout`."""
        t0 = time.perf_counter()
        if self._group_alive():
            try:
                os.killpg(self.pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = t0 + timeout
        while time.perf_counter() < deadline:
            self.proc.poll()
            if self.proc.returncode is not None and not self._group_alive():
                break
            time.sleep(0.2)
        else:
            print("the server did not stop in time: SIGKILL", flush=True)
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
            end = time.perf_counter() + 30
            while self._group_alive() and time.perf_counter() < end:
                time.sleep(0.2)
        self.log_file.close()
        return time.perf_counter() - t0
