"""/v1/completions, /v1/models, /tokenize, /detokenize, /version and /metrics through the official
openai client and httpx against a real `pagedllm serve` process."""
from __future__ import annotations

import httpx
import pytest
from serve_helpers import sse_events

MODEL = "tiny-mistral"
PROMPT = "The quick brown fox jumps over the lazy dog because"


def _tokenize(server, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, headers=server.headers)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_models_lists_every_served_name(client, completions_server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-mistral", "alias"]
    assert models.data[0].max_model_len == 256
    # The alias works as a model name too.
    out = client.completions.create(model="alias", prompt="Hi", max_tokens=2, temperature=0)
    assert out.model == MODEL


def test_stream_joined_equals_non_stream_with_exact_usage(client, completions_server):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    num_prompt = len(_tokenize(completions_server, PROMPT))
    assert full.usage.prompt_tokens == num_prompt
    assert full.usage.completion_tokens == 24
    assert full.usage.total_tokens == num_prompt + 24

    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == num_prompt
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_stream_format_ends_with_done(completions_server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{completions_server.url}/v1/completions", json=body,
                      headers=completions_server.headers, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    blocks = raw.split("\n\n")[:-1]
    assert all(b.startswith("data: ") for b in blocks)
    events = sse_events(raw.splitlines())
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" for e in events[:-1])


def test_n_choices_each_finish_exactly_once(client, completions_server):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=12, n=3, temperature=1.0, seed=7,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    assert full.usage.completion_tokens == 36
    chunks = list(client.completions.create(**kwargs, stream=True))
    texts, finishes = {}, {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason is not None:
                finishes[ch.index] = finishes.get(ch.index, 0) + 1
    assert finishes == {0: 1, 1: 1, 2: 1}
    # Seeded sampling reproduces the non-streamed choices exactly.
    assert texts == {c.index: c.text for c in full.choices}
    assert len(set(texts.values())) > 1


def test_seed_reproducible_and_different_seeds_differ(client, completions_server):
    def run(seed):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
                                          extra_body={"ignore_eos": True}).choices[0].text

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_batch_and_token_id_prompts(client, completions_server):
    ids = _tokenize(completions_server, PROMPT)
    out = client.completions.create(model=MODEL, prompt=[PROMPT, "Another prompt"], max_tokens=6, n=2,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in sorted(out.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 4 * 6
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    first = sorted(out.choices, key=lambda c: c.index)[0]
    assert by_ids.choices[0].text == first.text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_stop_string_and_stop_reason(client, completions_server):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 3]
    assert stop.strip()
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == base[: base.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                            stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == base[: base.index(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_logprobs_completions_format(client, completions_server):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3
        # Greedy: the chosen token is the most likely one.
        assert top[tok] == pytest.approx(val) and val == pytest.approx(max(top.values()))
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)


def test_echo_and_vllm_extras(client, completions_server):
    out = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text.startswith("Hello there")
    extras = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.8, seed=3,
        extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.2, "min_tokens": 8, "ignore_eos": False,
                    "stop_token_ids": [2], "skip_special_tokens": True},
    )
    assert extras.usage.completion_tokens == 8


def test_prefix_cache_hits_reported_as_cached_tokens(client, completions_server):
    prompt = "A shared system prompt that is long enough to fill several KV blocks of sixteen tokens each. " * 2
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    details = again.usage.prompt_tokens_details
    assert details.cached_tokens >= 16 and details.cached_tokens % 16 == 0
    assert details.cached_tokens < again.usage.prompt_tokens


def test_tokenize_detokenize_version(completions_server):
    h = completions_server.headers
    ids = _tokenize(completions_server, "Hello world")
    assert ids[0] == 1  # BOS
    r = httpx.post(f"{completions_server.url}/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}, headers=h)
    assert r.json()["tokens"] == ids[1:] and r.json()["max_model_len"] == 256 and r.json()["count"] == len(ids) - 1
    r = httpx.post(f"{completions_server.url}/detokenize", json={"tokens": ids[1:]}, headers=h)
    assert r.json() == {"prompt": "Hello world"}
    r = httpx.post(f"{completions_server.url}/detokenize", json={"tokens": [32000]}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.get(f"{completions_server.url}/version", headers=h)
    assert r.status_code == 200 and r.json()["version"]


def _histogram(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram in a /metrics body."""
    values = {}
    for line in text.splitlines():
        for part in ("_sum", "_count"):
            if line.startswith(name + part + "{"):
                values[part] = float(line.rsplit(" ", 1)[1])
    return values["_sum"], values["_count"]


def test_metrics_exposed_with_vllm_names(client, completions_server):
    def metrics() -> str:
        return httpx.get(f"{completions_server.url}/metrics", headers=completions_server.headers).text

    before = metrics()
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    text = metrics()
    # One request: one queue time, one prefill time (first scheduled to first token in the core), and
    # that prefill lies inside the request's time to first token at the front-end.
    (q0, qn0), (q1, qn1) = (_histogram(t, "pagedllm:request_queue_time_seconds") for t in (before, text))
    (p0, pn0), (p1, pn1) = (_histogram(t, "pagedllm:request_prefill_time_seconds") for t in (before, text))
    (t0, tn0), (t1, tn1) = (_histogram(t, "pagedllm:time_to_first_token_seconds") for t in (before, text))
    assert qn1 - qn0 == pn1 - pn0 == tn1 - tn0 == 1
    assert 0 < (q1 - q0) + (p1 - p0) < t1 - t0
    for name in (
        "pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:kv_cache_usage_perc",
        "pagedllm:prefix_cache_queries_total", "pagedllm:prefix_cache_hits_total", "pagedllm:num_preemptions_total",
        "pagedllm:prompt_tokens_total", "pagedllm:generation_tokens_total", "pagedllm:request_success_total",
        "pagedllm:time_to_first_token_seconds_bucket", "pagedllm:inter_token_latency_seconds_bucket",
        "pagedllm:e2e_request_latency_seconds_count", "pagedllm:request_queue_time_seconds_count",
        "pagedllm:request_prefill_time_seconds_count",
    ):
        assert name in text, name
    assert 'finished_reason="length"' in text
    assert "_created" not in text
