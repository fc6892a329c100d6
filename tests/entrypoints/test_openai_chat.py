"""/v1/chat/completions through the official openai client: Qwen3's chat template, streaming equal to
non-streaming, one finish_reason per choice, exact usage, chat-format logprobs and chat errors."""
from __future__ import annotations

import httpx
import openai
import pytest
from serve_helpers import sse_events

MODEL = "tiny-qwen"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


def _prompt_tokens(server, messages) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_template_rendering_matches_transformers(chat_server):
    from assets import load_tokenizer

    tok = load_tokenizer("qwen3")
    expected = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)
    assert _prompt_tokens(chat_server, MESSAGES) == expected


def test_chat_stream_equals_non_stream_with_exact_usage(chat_client, chat_server):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})
    full = chat_client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and choice.message.content
    num_prompt = len(_prompt_tokens(chat_server, MESSAGES))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (
        num_prompt, 20, num_prompt + 20)

    chunks = list(chat_client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == num_prompt


def test_chat_n_and_raw_stream(chat_server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 5,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{chat_server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    finishes: dict[int, int] = {}
    roles: dict[int, int] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            if c["delta"].get("role"):
                roles[c["index"]] = roles.get(c["index"], 0) + 1
            if c["finish_reason"]:
                finishes[c["index"]] = finishes.get(c["index"], 0) + 1
    assert finishes == {0: 1, 1: 1} and roles == {0: 1, 1: 1}


def test_chat_logprobs_format(chat_client, chat_server):
    out = chat_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the best one
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    no_top = chat_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0,
                                                 logprobs=True)
    assert all(e.top_logprobs == [] for e in no_top.choices[0].logprobs.content)
    assert chat_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices[0].logprobs is None


def test_chat_content_parts_and_stop(chat_client, chat_server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colours."}]}]
    plain = [{"role": "user", "content": "Name three colours."}]
    assert _prompt_tokens(chat_server, parts) == _prompt_tokens(chat_server, plain)
    # Seeded sampling: greedy decoding of this random model only repeats newlines.
    kwargs = dict(model=MODEL, max_tokens=16, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    base = chat_client.chat.completions.create(messages=plain, **kwargs).choices[0].message.content
    stop = next(base[i:i + 2] for i in range(len(base) // 2, len(base)) if base[i:i + 2].strip())
    out = chat_client.chat.completions.create(messages=parts, stop=stop, **kwargs)
    assert out.choices[0].message.content == base[: base.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_chat_errors(chat_client, chat_server):
    with pytest.raises(openai.BadRequestError) as e:
        chat_client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs" and "20" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=1000)
    n = len(_prompt_tokens(chat_server, MESSAGES))
    body = e.value.body
    assert body["param"] == "max_completion_tokens" and "256" in body["message"] and str(n + 1000) in body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat_client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        chat_client.chat.completions.create(model=MODEL, messages=[])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        chat_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 300}])
    assert e.value.body["param"] == "messages" and "256" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        chat_client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
