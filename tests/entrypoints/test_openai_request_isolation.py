"""Requests that once killed the engine core for everyone: each is refused or served alone, and the server
goes on serving the others."""
from __future__ import annotations

import concurrent.futures

import httpx
import pytest


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=120)


def _still_serves(server) -> None:
    r = _post(server, {"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("extra", [{}, {"allowed_token_ids": [5, 6, 7]}])
@pytest.mark.parametrize("temperature", [1e39, 1e308])
def test_a_temperature_float32_cannot_hold_is_refused(completions_server, temperature, extra):
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": temperature, "min_tokens": 2, **extra}
    r = _post(completions_server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "temperature" and "float32" in err["message"]
    _still_serves(completions_server)


def test_a_parent_and_another_requests_child_may_share_a_name(completions_server):
    """While "victim" (n=2) streams, a request called "0_victim" (the name the first child once had inside
    the engine) comes in; both complete."""
    from serve_helpers import sse_events

    victim = {"prompt": "Once upon a time", "max_tokens": 40, "n": 2, "temperature": 1.0, "seed": 1,
              "ignore_eos": True, "request_id": "victim", "stream": True}
    other = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
             "request_id": "0_victim"}
    lines, second = [], None
    url, headers = f"{completions_server.url}/v1/completions", completions_server.headers
    with httpx.stream("POST", url, json=victim, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            lines.append(line)
            if second is None and line.startswith("data: {"):
                second = _post(completions_server, other)  # the victim is in flight now
    assert second is not None and second.status_code == 200, second.text if second is not None else lines
    assert second.json()["choices"][0]["finish_reason"] == "length"
    events = sse_events(lines)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict))
    finishes = sorted((c["index"], c["finish_reason"]) for e in events[:-1] for c in e["choices"] if c["finish_reason"])
    assert finishes == [(0, "length"), (1, "length")]
    _still_serves(completions_server)
