"""Asynchronous scheduling (step N+1 scheduled while step N runs) gives the same outputs as synchronous."""
from __future__ import annotations

import pytest
from tiny_models import make_tiny_model_with_tokenizer

from pagedllm import LLM, SamplingParams

PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "A list of prime numbers: 2, 3, 5,",
    "def fibonacci(n):",
    "In the beginning",
    "Hello",
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model_with_tokenizer("mistral", tmp_path_factory.mktemp("async-model"))


def _llm(path: str, async_scheduling: bool, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 1 << 24)
    return LLM(model=path, dtype="float32", device="cpu", max_model_len=128, async_scheduling=async_scheduling, **kwargs)


def _params(stop_token: int) -> list[SamplingParams]:
    """A mix that exercises every way a request ends and everything the sampler reads from the host."""
    return [
        SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_token], ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.8, seed=7, max_tokens=25, repetition_penalty=1.3, logprobs=3),
        SamplingParams(temperature=1.0, seed=3, max_tokens=30, n=2, frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=5, stop_token_ids=[stop_token], prompt_logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    ]


def _summary(outs):
    return [
        [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs] for o in outs
    ]


def _logprobs(outs):
    return [[[sorted(d.items()) for d in (c.logprobs or [])] for c in o.outputs] for o in outs]


def _assert_same(a, b):
    assert _summary(a) == _summary(b)
    for la, lb in zip(_logprobs(a), _logprobs(b)):
        for ca, cb in zip(la, lb):
            for pa, pb in zip(ca, cb):
                assert [t for t, _ in pa] == [t for t, _ in pb]
                assert all(abs(x.logprob - y.logprob) < 1e-4 for (_, x), (_, y) in zip(pa, pb))


def _stop_token(llm: LLM) -> int:
    # A token greedy decoding of prompt 1 produces mid-way, so the stop condition really fires.
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].token_ids[6]


def _free(llm: LLM) -> bool:
    pool = llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_blocks


@pytest.mark.parametrize("engine_kwargs", [
    {},
    {"max_num_batched_tokens": 8},  # chunked prefill: pending tokens only on the last chunk
    {"num_gpu_blocks_override": 16, "block_size": 8, "enable_prefix_caching": False},  # preemption with steps in flight
])
def test_async_matches_sync(model_path, engine_kwargs):
    sync = _llm(model_path, False, **engine_kwargs)
    stop = _stop_token(sync)
    params = _params(stop)
    expected = sync.generate(PROMPTS, params, use_tqdm=False)
    assert any(c.finish_reason == "stop" for o in expected for c in o.outputs)

    llm = _llm(model_path, True, **engine_kwargs)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    _assert_same(expected, got)
    assert _free(llm) and not llm.llm_engine.has_unfinished_requests()
    if "num_gpu_blocks_override" in engine_kwargs:
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    # The async engine stays usable: a second batch (prefix hits on the first) gives the same again.
    _assert_same(expected, llm.generate(PROMPTS, params, use_tqdm=False))


def test_async_stop_string_and_abort_free_everything(model_path):
    sync = _llm(model_path, False)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    text = sync.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    with_stop = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop])

    llm = _llm(model_path, True)
    assert _summary(llm.generate(PROMPTS[0], with_stop, use_tqdm=False)) == _summary(
        sync.generate(PROMPTS[0], with_stop, use_tqdm=False)
    )
    engine = llm.llm_engine
    engine.add_request("keep", "first request", SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("drop", "second request", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()  # "drop" now has a step in flight
    engine.abort_request(["drop"])
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            finished[o.request_id] = o
    assert set(finished) == {"keep"} and len(finished["keep"].outputs[0].token_ids) == 6
    assert _free(llm)


def _core_run(llm: LLM, emit: bool) -> tuple[dict, list[bool]]:
    """Drives the engine core directly; with ``emit``, outputs come through ``emit_outputs``."""
    engine = llm.llm_engine
    core = engine.engine_core
    runner = core.executor.worker.model_runner
    tokens: dict[str, list[int]] = {}
    sampling_pending: list[bool] = []

    def collect(outputs, emitted=False):
        if emitted:
            sampling_pending.append(runner._deferred is not None)
        for o in outputs:
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)

    core.emit_outputs = (lambda outs: collect(outs, True)) if emit else None
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=5 + 3 * i, ignore_eos=True))
    while core.has_unfinished_requests():
        collect(core.step())
    core.emit_outputs = None
    return tokens, sampling_pending


def test_outputs_leave_before_the_next_steps_sampling(model_path):
    # The serving loop's emitter gets each step's outputs while the next step's sampling still waits to
    # be launched, and the tokens are those of the plain asynchronous loop.
    expected, _ = _core_run(_llm(model_path, True), emit=False)
    llm = _llm(model_path, True)
    got, sampling_pending = _core_run(llm, emit=True)
    assert got == expected and {len(t) for t in got.values()} == {5 + 3 * i for i in range(len(PROMPTS))}
    # Every emission but the last (nothing left to submit) came before a launched step's sampling.
    assert sampling_pending[:-1] and all(sampling_pending[:-1]) and not sampling_pending[-1]
    assert llm.llm_engine.engine_core.executor.worker.model_runner._deferred is None and _free(llm)
