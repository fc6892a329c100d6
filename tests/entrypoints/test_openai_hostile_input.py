"""What a request's content may do to the server: hostile bodies (lone surrogates, deep nesting, non-JSON
numbers, huge lists) are 400s naming the field; fields the server does not implement are refused by
name, never ignored; a request's chat template is refused unless trusted, and bounded in size and time
when trusted; and neither tokenizing a 15 MB prompt nor a runaway template freezes the event loop."""
from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest

MODEL = "tiny-mistral"
MESSAGES = [{"role": "user", "content": "hi"}]
# A ChatML template, for the completions server (its tokenizer carries none of its own).
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"


def _post(server, path: str, body=None, content: bytes | None = None, timeout: float = 60) -> httpx.Response:
    headers = dict(server.headers)
    if content is not None:
        headers["content-type"] = "application/json"
        return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=timeout)
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=timeout)


def _error(r: httpx.Response, status: int = 400, param: str | None = "?", contains: tuple[str, ...] = ()) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param != "?":
        assert err["param"] == param, err
    for s in contains:
        assert s in err["message"], err["message"]
    return err


def _healthy(server) -> None:
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- item 3: content that used to be a 500 ------------------------------------------------------------
@pytest.mark.parametrize(
    "path,raw,param,where",
    [
        ("/v1/completions", '{"prompt": "abc \\ud800 def", "max_tokens": 2}', "prompt", "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "abc \\udfff"], "max_tokens": 2}', "prompt", "prompt[1]"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "abc \\ud800 def"}]}', "messages",
         "messages[0].content"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}]}',
         "messages", "messages[0].content[0].text"),
        ("/tokenize", '{"prompt": "abc \\ud800 def"}', "prompt", "prompt"),
        ("/v1/completions", '{"prompt": "x", "model": "\\ud800"}', "model", "model"),
        ("/v1/completions", '{"prompt": "x", "logit_bias": {"\\ud800": 1}}', "logit_bias", "logit_bias"),
    ],
)
def test_lone_surrogates_are_400s_naming_the_field(completions_server, path, raw, param, where):
    err = _error(_post(completions_server, path, content=raw.encode()), 400, param, contains=(where, "surrogate"))
    assert err["type"] == "invalid_request_error"


def test_deep_nesting_and_non_json_numbers_are_400s(completions_server):
    deep = b'{"prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}"
    _error(_post(completions_server, "/v1/completions", content=deep), 400, contains=("nested",))
    _error(_post(completions_server, "/v1/completions", content=b"[" * 10000 + b"]" * 10000), 400, contains=("nested",))
    kwargs = b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": ' + b'{"a": ' * 100 + b"1" + b"}" * 101
    _error(_post(completions_server, "/v1/chat/completions", content=kwargs), 400, "chat_template_kwargs", contains=("64",))
    for literal in ("NaN", "Infinity", "-Infinity"):
        raw = f'{{"prompt": "x", "max_tokens": 2, "temperature": {literal}}}'.encode()
        _error(_post(completions_server, "/v1/completions", content=raw), 400, contains=(literal, "not valid JSON"))
    raw = b'{"prompt": "x", "max_tokens": 2, "top_p": 1e999}'
    _error(_post(completions_server, "/v1/completions", content=raw), 400, contains=("1e999", "too large"))
    raw = b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"
    _error(_post(completions_server, "/v1/completions", content=raw), 400, contains=("digits",))
    _healthy(completions_server)


def test_wrong_types_and_huge_lists_are_400s(completions_server):
    cases = [
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "n": 2.0}, "n"),
        ({"prompt": "x", "temperature": "0.5"}, "temperature"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": "x", "stop": ["s"] * 65}, "stop"),
        ({"prompt": "x", "stop": "s" * 5000}, "stop"),
        ({"prompt": [[1]] * 200, "n": 8, "max_tokens": 1}, "prompt"),
    ]
    for body, param in cases:
        _error(_post(completions_server, "/v1/completions", body), 400, param)
    err = _error(_post(completions_server, "/v1/completions", {"prompt": "x", "stop": ["s"] * 65}), 400, "stop")
    assert "64" in err["message"] and "65" in err["message"]
    err = _error(_post(completions_server, "/v1/completions", {"prompt": [[1]] * 200, "n": 8}), 400, "prompt")
    assert "1600" in err["message"] and "1024" in err["message"]
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}], "chat_template": TEMPLATE}
    _error(_post(completions_server, "/v1/chat/completions", chat), 400, "messages")
    _healthy(completions_server)


def test_unexpected_errors_hide_their_text_and_log_it_under_an_id(caplog):
    from pagedllm.entrypoints.openai.errors import internal_error_body

    exc = RuntimeError("secret internals at /srv/model")
    with caplog.at_level(logging.ERROR, logger="pagedllm"):
        body = internal_error_body(exc, "/v1/completions")
    message = body["error"]["message"]
    assert "secret" not in message and "RuntimeError" not in message
    error_id = message.split("(id ")[1].split(")")[0]
    record = next(r for r in caplog.records if error_id in r.getMessage())
    assert record.exc_info[1] is exc and "/v1/completions" in record.getMessage()


# ---- item 7: fields that would be ignored ---------------------------------------------------------------
@pytest.mark.parametrize(
    "path,field,value,says",
    [
        # tool_choice defaults to "auto" with tools, which needs the server's auto-tool-choice flags.
        ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}],
         "--enable-auto-tool-choice"),
        ("/v1/chat/completions", "tool_choice", "required", "needs tools"),
        ("/v1/chat/completions", "functions", [{"name": "f"}], "deprecated"),
        ("/v1/completions", "response_format", {"type": "json_schema", "json_schema": {}}, "json_schema.schema"),
        ("/v1/completions", "guided_decoding_backend", "outlines", "xgrammar"),
        ("/v1/chat/completions", "guided_whitespace_pattern", " *", "disable_any_whitespace"),
        ("/v1/completions", "structured_outputs", {"regex": "a", "whitespace_pattern": " "}, "whitespace_pattern"),
        ("/v1/completions", "prompt_logprobs", 1, "prompt_logprobs"),
        ("/v1/completions", "temprature", 0.5, "unknown fields"),
        ("/v1/chat/completions", "echo", True, "unknown fields"),
        ("/tokenize", "add_special_token", False, "unknown fields"),
    ],
)
def test_unsupported_fields_are_refused_by_name(completions_server, path, field, value, says):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2} if path != "/v1/chat/completions" else \
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "chat_template": TEMPLATE}
    if path == "/tokenize":
        body = {"prompt": "x"}
    body[field] = value
    err = _error(_post(completions_server, path, body), 400, field, contains=(field, says))
    assert err["type"] == "invalid_request_error"


def test_fields_at_values_that_change_nothing_are_accepted(completions_server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "chat_template": TEMPLATE,
            "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "parallel_tool_calls": False,
            "prompt_logprobs": None, "store": False, "metadata": {"team": "search"}, "user": "u-1",
            "service_tier": "auto"}
    assert _post(completions_server, "/v1/chat/completions", body).status_code == 200


def test_stream_options_needs_stream_and_logprobs_takes_an_int(completions_server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream_options": {"include_usage": True}}
    _error(_post(completions_server, "/v1/completions", body), 400, "stream_options", contains=("stream",))
    body.update(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    _error(_post(completions_server, "/v1/completions", body), 400, "stream_options", contains=("continuous_usage_stats",))
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "logprobs": True}
    _error(_post(completions_server, "/v1/completions", body), 400, "logprobs", contains=("integer",))


# ---- item 4: chat templates from requests, and the event loop -----------------------------------------
def test_request_chat_template_needs_the_trust_flag(chat_server):
    body = {"model": "tiny-qwen", "messages": MESSAGES, "max_tokens": 2, "chat_template": TEMPLATE}
    _error(_post(chat_server, "/v1/chat/completions", body), 400, "chat_template",
           contains=("chat_template", "--trust-request-chat-template"))
    _error(_post(chat_server, "/tokenize", {"messages": MESSAGES, "chat_template": TEMPLATE}), 400, "chat_template")
    # The server's own template still renders, with chat_template_kwargs as template variables only.
    r = _post(chat_server, "/tokenize", {"messages": MESSAGES})
    assert r.status_code == 200 and r.json()["count"] > 0
    body = {"model": "tiny-qwen", "messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"messages": []}}
    _error(_post(chat_server, "/v1/chat/completions", body), 400, "chat_template_kwargs", contains=("messages",))


def test_trusted_request_template_renders(completions_server):
    r = _post(completions_server, "/tokenize", {"messages": MESSAGES, "chat_template": TEMPLATE})
    assert r.status_code == 200, r.text
    r = _post(completions_server, "/v1/chat/completions",
              {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "chat_template": TEMPLATE})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "template,says",
    [
        ("{% set x = 'a' * 300000000 %}{{ x }}", "300000000"),
        ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
         "limit"),
        ("{{ '{:>300000000}'.format(1) }}", "300000000"),
        ("{% set s = 'a' * 100000 %}{{ s.replace('a', s) }}", "limit"),
        ("{{ ().__class__.__base__.__subclasses__() }}", "unsafe"),
    ],
)
def test_template_size_bounds(completions_server, template, says):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "chat_template": template}
    t0 = time.monotonic()
    _error(_post(completions_server, "/v1/chat/completions", body, timeout=30), 400, "chat_template", contains=(says,))
    assert time.monotonic() - t0 < 10


def _health_latencies(server, busy: threading.Event) -> list[float]:
    """/health round trips, timed, while `busy` is set (and at least one)."""
    out = []
    with httpx.Client(timeout=30) as c:
        while True:
            t0 = time.monotonic()
            assert c.get(f"{server.url}/health").status_code == 200
            out.append(time.monotonic() - t0)
            if not busy.is_set():
                return out
            time.sleep(0.05)


def _in_background(fn) -> tuple[threading.Thread, threading.Event, dict]:
    busy, result = threading.Event(), {}
    busy.set()

    def run() -> None:
        try:
            result["response"] = fn()
        except Exception as e:  # noqa: BLE001 - reported by the test
            result["error"] = e
        finally:
            busy.clear()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, busy, result


def test_runaway_template_is_stopped_without_freezing_the_loop(completions_server):
    nested = ("{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
              "{% endfor %}{% endfor %}{% endfor %}")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "chat_template": nested}
    t0 = time.monotonic()
    thread, busy, result = _in_background(lambda: _post(completions_server, "/v1/chat/completions", body, timeout=60))
    time.sleep(0.3)
    latencies = _health_latencies(completions_server, busy)
    thread.join(timeout=60)
    assert "error" not in result, result
    _error(result["response"], 400, "chat_template", contains=("longer than",))
    assert time.monotonic() - t0 < 20
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies


@pytest.mark.slow
def test_tokenizing_a_15_mb_prompt_leaves_health_fast(chat_server):
    prompt = "hello world, " * (15_000_000 // 13)
    body = {"model": "tiny-qwen", "prompt": prompt, "max_tokens": 1}
    thread, busy, result = _in_background(lambda: _post(chat_server, "/v1/completions", body, timeout=120))
    time.sleep(0.5)
    latencies = _health_latencies(chat_server, busy)
    thread.join(timeout=120)
    assert "error" not in result, result
    _error(result["response"], 400, "prompt", contains=("maximum context length",))
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies


def test_a_repetition_penalty_that_overflows_float32_is_refused(completions_server):
    """Dividing a logit by 1e-45 (0 in float32) made the request's logits non-finite; now it never starts."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "repetition_penalty": 1e-45}
    r = _post(completions_server, "/v1/completions", body)
    _error(r, 400, "repetition_penalty", contains=("[0.01, 2]",))
    _healthy(completions_server)
