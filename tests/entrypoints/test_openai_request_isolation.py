"""Requests that once killed the engine core for everyone: each is refused or served alone, and the server
goes on serving the others."""
from __future__ import annotations

import re

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


# ---- a request whose logits are NaN, end to end ---------------------------------------------------------
POISON = 7  # this token's input embedding is NaN: any request whose prompt holds it has NaN logits


@pytest.fixture(scope="module")
def poisoned_server(tmp_path_factory):
    """A server whose model turns one token's embedding into NaN: a real per-request numerical failure,
    as a bad checkpoint or an overflow in some layer makes one."""
    import torch
    from safetensors.torch import load_file, save_file
    from serve_helpers import Server, make_model

    root = tmp_path_factory.mktemp("poisoned")
    path = make_model("mistral", root / "model")
    weights_file = f"{path}/model.safetensors"
    weights = load_file(weights_file)
    weights["model.embed_tokens.weight"][POISON] = float("nan")
    save_file(weights, weights_file, metadata={"format": "pt"})
    server = Server("poisoned", path, ["--served-model-name", "poisoned", "--async-scheduling"], root)
    yield server.wait_ready()
    server.stop()


def test_a_request_with_nan_logits_fails_alone_end_to_end(poisoned_server):
    url = f"{poisoned_server.url}/v1/completions"
    good = {"prompt": [3, 4, 5, 6], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    bad = {"prompt": [3, 4, POISON, 6], "max_tokens": 40, "temperature": 0.8, "ignore_eos": True}
    expected = httpx.post(url, json=good, timeout=60).json()["choices"][0]["text"]
    # The good request streams while the bad ones come and fail beside it.
    from serve_helpers import sse_events

    with httpx.stream("POST", url, json={**good, "stream": True}, timeout=60) as s:
        lines, failed = [], []
        for line in s.iter_lines():
            lines.append(line)
            if not failed and line.startswith("data: {"):
                failed.append(httpx.post(url, json=bad, timeout=60))
                with httpx.stream("POST", url, json={**bad, "stream": True}, timeout=60) as b:
                    failed.append(sse_events(b.iter_lines()))
    events = sse_events(lines)
    assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1]) == expected
    r, bad_events = failed
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "request_failed" and "no valid token" in err["message"], err
    assert bad_events[-1] == "[DONE]" and bad_events[-2]["error"]["code"] == "request_failed", bad_events
    # Every block is free again and the server goes on.
    metrics = httpx.get(f"{poisoned_server.url}/metrics", timeout=10).text
    usage = re.search(r"^pagedllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", metrics, re.M)
    assert usage is not None and float(usage.group(1)) == 0.0
    assert httpx.get(f"{poisoned_server.url}/health", timeout=10).status_code == 200
    assert httpx.post(url, json=good, timeout=60).json()["choices"][0]["text"] == expected
