"""`pagedllm serve -dp 2` on loopback: the official openai client's concurrent requests are served by
both engine cores, /metrics has series for engine="0" and engine="1"; then one core is killed: the
request in flight fails, /health turns 503, the server exits with status 1 and no core is left."""
from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from serve_helpers import Server, make_model, sse_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
MODEL = "tiny-dp"


def _core_pids(server: Server) -> list[int]:
    pids = []
    for pid in server.children():
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())
        except psutil.NoSuchProcess:
            continue
        if "spawn_main" in cmd and "resource_tracker" not in cmd:
            pids.append(pid)
    return pids


def _generated_by_engine(metrics: str) -> dict[str, float]:
    found = re.findall(r'pagedllm:generation_tokens_total\{engine="(\d+)",model_name="tiny-dp"\} ([0-9.e+]+)', metrics)
    return {e: float(v) for e, v in found}


def test_dp2_serves_with_both_cores_then_dies_cleanly(tmp_path: Path):
    model = make_model("mistral", tmp_path / "model")
    server = Server("dp", model, ["-dp", "2", "--served-model-name", MODEL], tmp_path)
    try:
        server.wait_ready()
        cores = _core_pids(server)
        assert len(cores) == 2, cores
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

        async def main():
            # Distinct prompts of different first blocks, so least-loaded routing spreads them.
            return await asyncio.gather(*[
                client.completions.create(model=MODEL, prompt=f"{i} " * (3 + i), max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
                for i in range(8)
            ])

        outs = asyncio.run(main())
        assert all(o.usage.completion_tokens == 6 for o in outs)
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        by_engine = _generated_by_engine(metrics)
        assert set(by_engine) == {"0", "1"}, by_engine
        assert all(v > 0 for v in by_engine.values()) and sum(by_engine.values()) == 48, by_engine

        # A core dies mid-request: the stream ends in an engine_dead error, the server goes unhealthy, exits 1.
        body = {"model": MODEL, "prompt": "Doomed", "max_tokens": 240, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines, killed = [], False
            for line in r.iter_lines():
                lines.append(line)
                if not killed and len([ln for ln in lines if ln.startswith("data: ")]) == 2:
                    killed = True
                    os.kill(cores[1], signal.SIGKILL)  # whichever core runs it: every request fails
            events = sse_events(lines)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead", events[-3:]
        health = httpx.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 503
        assert server.proc.wait(timeout=20) == 1
        assert "data-parallel engine core 1" in server.log_tail(20000)
        assert not [p for p in cores if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    finally:
        server.stop()
