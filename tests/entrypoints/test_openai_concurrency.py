"""Load on one server: 100 concurrent streams of which 10 disconnect mid-way. The other 90 complete
with their exact token counts; the disconnected ones are aborted at once, and the engine ends idle
(0 running, 0 waiting, KV-cache usage 0). A disconnecting non-streaming client is aborted too."""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx

MODEL = "tiny-mistral"


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} ([0-9.e+-]+)$"
    m = re.search(pattern, text, re.M)
    assert m, f"{name} {labels} not in metrics"
    return float(m.group(1))


def _metrics(server) -> str:
    return httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=30).text


def _wait_idle(server, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = _metrics(server)
        idle = (
            _metric(text, "pagedllm:num_requests_running") == 0
            and _metric(text, "pagedllm:num_requests_waiting") == 0
            and _metric(text, "pagedllm:kv_cache_usage_perc") == 0
        )
        if idle or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


async def _stream(client: httpx.AsyncClient, server, i: int, disconnect: bool) -> dict:
    max_tokens = 200 if disconnect else 16
    body = {
        "model": MODEL, "prompt": f"Request number {i} says", "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    result = {"chunks": 0, "finish": [], "usage": None, "done": False}
    async with client.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                result["done"] = True
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                result["usage"] = chunk["usage"]
            for c in chunk["choices"]:
                result["chunks"] += 1
                if c.get("finish_reason"):
                    result["finish"].append(c["finish_reason"])
            if disconnect and result["chunks"] >= 3:
                break  # leaving the block closes the connection mid-stream
    return result


def test_100_streams_10_disconnect(completions_server):
    before = _metrics(completions_server)
    aborted_before = _metric(before, "pagedllm:request_success_total", 'finished_reason="abort"')

    async def main():
        limits = httpx.Limits(max_connections=110, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            return await asyncio.gather(*[_stream(client, completions_server, i, i % 10 == 0) for i in range(100)])

    results = asyncio.run(main())
    kept = [r for i, r in enumerate(results) if i % 10]
    dropped = [r for i, r in enumerate(results) if i % 10 == 0]
    assert len(kept) == 90 and len(dropped) == 10
    for r in kept:
        assert r["done"] and r["finish"] == ["length"]
        assert r["usage"]["completion_tokens"] == 16
    for r in dropped:
        assert not r["done"] and r["finish"] == []
    text = _wait_idle(completions_server)
    assert _metric(text, "pagedllm:num_requests_running") == 0
    assert _metric(text, "pagedllm:num_requests_waiting") == 0
    assert _metric(text, "pagedllm:kv_cache_usage_perc") == 0
    # Each disconnect was recorded as an abort (the 200-token streams never ran to their end).
    assert _metric(text, "pagedllm:request_success_total", 'finished_reason="abort"') - aborted_before == 10


def test_non_streaming_disconnect_aborts(completions_server):
    before = _metric(_metrics(completions_server), "pagedllm:request_success_total", 'finished_reason="abort"')
    body = {"model": MODEL, "prompt": "Long one", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    try:
        # 240 tokens take far longer than 0.1 s; the client leaves while the request runs.
        httpx.post(f"{completions_server.url}/v1/completions", json=body, headers=completions_server.headers, timeout=0.1)
    except httpx.TimeoutException:
        pass  # the client gave up and closed the connection while the request was running
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = _metrics(completions_server)
        if _metric(text, "pagedllm:request_success_total", 'finished_reason="abort"') == before + 1:
            break
        time.sleep(0.1)
    assert _metric(text, "pagedllm:request_success_total", 'finished_reason="abort"') == before + 1
    text = _wait_idle(completions_server)
    assert _metric(text, "pagedllm:num_requests_running") == 0
    assert _metric(text, "pagedllm:kv_cache_usage_perc") == 0
