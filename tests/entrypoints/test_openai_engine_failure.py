"""Overload and failure on the "chat" server (2 running, 2 waiting at most): 429 with Retry-After
past the waiting limit; then its engine-core process is killed mid-request: 500 for a non-streaming
request, an error chunk then [DONE] for a streaming one, /health and new requests 503, and the
server exits with status 1 (so that a supervisor restarts it), saying why. It is marked for a
restart afterwards, should any later test need it."""
from __future__ import annotations

import asyncio
import os
import signal
import threading

import httpx
import openai
import pytest
from serve_helpers import sse_events

MODEL = "tiny-qwen"


def test_too_many_waiting_requests_get_429(chat_server):
    body = {"model": MODEL, "prompt": "Busy", "max_tokens": 60, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(timeout=180) as client:
            return await asyncio.gather(
                *[client.post(f"{chat_server.url}/v1/completions", json=body) for _ in range(12)]
            )

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    # At most 2 running + 2 waiting are accepted while the long requests occupy the engine.
    assert 1 <= codes.count(200) <= 4 and codes.count(429) >= 8, codes
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and "waiting" in err["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 60
    # Once the queue drains, requests are accepted again; the client sees 429 as RateLimitError.
    c = openai.OpenAI(base_url=f"{chat_server.url}/v1", api_key="x", max_retries=0)
    assert c.completions.create(model=MODEL, prompt="Free", max_tokens=2).usage.completion_tokens == 2


def test_engine_death_fails_requests_and_health(chat_server):
    try:
        _kill_engine_and_check(chat_server)
    finally:
        chat_server.needs_restart = True


def _kill_engine_and_check(chat_server):
    url = chat_server.url
    body = {"model": MODEL, "prompt": "Doomed", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    result: dict = {}

    def non_streaming():
        result["full"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)

    thread = threading.Thread(target=non_streaming)
    thread.start()
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = []
        killed = False
        for line in r.iter_lines():
            lines.append(line)
            # Kill once: the blank separator lines that follow must not trigger a second look-up.
            if not killed and len([ln for ln in lines if ln.startswith("data: ")]) == 2:
                os.kill(chat_server.core_pid(), signal.SIGKILL)  # both requests are running now
                killed = True
        events = sse_events(lines)
    thread.join(120)
    assert events[-1] == "[DONE]"
    errors = [e for e in events[:-1] if "error" in e]
    assert len(errors) == 1 and events[-2] is errors[0]
    assert errors[0]["error"]["code"] == "engine_dead" and errors[0]["error"]["type"] == "internal_server_error"
    full = result["full"]
    assert full.status_code == 500
    assert full.json()["error"]["code"] == "engine_dead"

    # Until it exits, the server says why it takes nothing: /health and new requests get 503.
    health = httpx.get(f"{url}/health", timeout=5)
    assert health.status_code == 503 and "dead" in health.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2, "stream": True}, timeout=5)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as caught:
        c.models.list()
    assert caught.value.status_code == 503
    # Then it exits with a non-zero status within a few seconds, and its log says why.
    assert chat_server.proc.wait(timeout=15) == 1
    log = chat_server.log_tail(20000)
    assert "engine core is dead" in log and "exited unexpectedly" in log and "exiting with status 1" in log, log
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=5)
