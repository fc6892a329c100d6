"""A failure inside the engine core ends only the requests it belongs to: non-finite logits, an exception in
one request's sampling, an exception in the model's forward pass; the other requests go on with the tokens
they would have had, every block is freed, and ids stay unique whatever clients call their requests."""
from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model_with_tokenizer

from pagedllm import LLM, SamplingParams
from pagedllm.engine.output_processor import OutputKind

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "In the beginning"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model_with_tokenizer("mistral", tmp_path_factory.mktemp("faults-model"))


def _llm(path: str, async_scheduling: bool, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 1 << 24)
    return LLM(model=path, dtype="float32", device="cpu", max_model_len=128, async_scheduling=async_scheduling, **kwargs)


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, seed=9, max_tokens=8, ignore_eos=True, n=2),
    ]


def _tokens(outs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _all_blocks_free(llm: LLM) -> bool:
    pool = llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_blocks


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_non_finite_logits_end_only_their_request(model_path, async_scheduling):
    llm = _llm(model_path, async_scheduling)
    expected = llm.generate(PROMPTS[:3], _params(), use_tqdm=False)
    # The request: a temperature past float32 (validation refuses it now; set behind its back)
    # turns the EOS logit that min_tokens masks into -inf / inf = NaN.
    victim = SamplingParams(temperature=1.0, max_tokens=4, min_tokens=2, seed=1)
    victim.temperature = 1e39
    outs = llm.generate(PROMPTS[:3] + [PROMPTS[3]], _params() + [victim], use_tqdm=False)
    assert _tokens(outs[:3]) == _tokens(expected)
    bad = outs[3].outputs[0]
    assert bad.finish_reason == "error" and "no valid token" in bad.stop_reason
    assert bad.token_ids == [], "no id outside a real draw may reach the client"
    assert _all_blocks_free(llm)
    # The engine goes on as before.
    assert _tokens(llm.generate(PROMPTS[:3], _params(), use_tqdm=False)) == _tokens(expected)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_exception_in_one_requests_sampling_ends_it_alone(model_path, async_scheduling):
    llm = _llm(model_path, async_scheduling)
    expected = llm.generate(PROMPTS[:3], _params(), use_tqdm=False)
    runner = _runner(llm)
    original = runner._sample

    def fails_for_seed_666(logits, states):
        if any(st.seed == 666 for st in states):
            raise RuntimeError("injected sampling fault")
        return original(logits, states)

    runner._sample = fails_for_seed_666
    victim = SamplingParams(temperature=0.7, seed=666, max_tokens=6, ignore_eos=True)
    outs = llm.generate(PROMPTS[:3] + [PROMPTS[3]], _params() + [victim], use_tqdm=False)
    assert _tokens(outs[:3]) == _tokens(expected)
    bad = outs[3].outputs[0]
    assert bad.finish_reason == "error" and bad.stop_reason == "sampling failed (RuntimeError)"
    assert "injected" not in bad.stop_reason, "exception text stays in the log"
    # Logprobs of the surviving rows keep their places.
    assert outs[1].outputs[0].logprobs is not None and len(outs[1].outputs[0].logprobs) == 10
    assert _all_blocks_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_forward_pass_ends_its_step_and_the_rest_goes_on(model_path, async_scheduling):
    # Two requests run at a time: the third waits, is in no step when the fault strikes, and must finish.
    llm = _llm(model_path, async_scheduling, max_num_seqs=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = llm.generate(PROMPTS[2], greedy, use_tqdm=False)
    engine = llm.llm_engine
    model = _runner(llm).model
    calls = {"n": 0}
    original = model.forward

    def fails_on_third_call(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected forward fault")
        return original(*args, **kwargs)

    model.forward = fails_on_third_call
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), prompt, greedy, OutputKind.FINAL_ONLY)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    model.forward = original
    for rid in ("0", "1"):
        assert finished[rid].outputs[0].finish_reason == "error"
        assert finished[rid].outputs[0].stop_reason == "the model step failed (RuntimeError)"
    assert _tokens([finished["2"]]) == _tokens(expected)
    assert _all_blocks_free(llm)
    # Nothing the failed step half wrote is served from the prefix cache afterwards.
    assert _tokens(llm.generate(PROMPTS[2], greedy, use_tqdm=False)) == _tokens(expected)


def test_request_ids_are_unique_by_construction(model_path):
    llm = _llm(model_path, False)
    engine = llm.llm_engine
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
    # The first child of "victim" was once called "0_victim", like the second request.
    engine.add_request("victim", PROMPTS[0], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True))
    engine.add_request("0_victim", PROMPTS[1], params)
    core_ids = list(engine.engine_core.scheduler.requests)
    assert len(core_ids) == len(set(core_ids)) == 3
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert [c.finish_reason for c in finished["victim"].outputs] == ["length", "length"]
    assert finished["0_victim"].outputs[0].finish_reason == "length"


def test_every_step_runs_under_inference_mode(model_path):
    """The serving loop launches sampling apart from the forward pass (EngineCore.emit_outputs); the
    logits buffer a GPU keeps across steps is an inference tensor, so every launch must be in that mode."""
    llm = _llm(model_path, True)
    core = llm.llm_engine.engine_core
    emitted = []
    core.emit_outputs = emitted.extend
    model = _runner(llm).model
    modes = []
    original = model.compute_logits

    def spy(*args, **kwargs):
        modes.append(torch.is_inference_mode_enabled())
        return original(*args, **kwargs)

    model.compute_logits = spy
    for i, req in enumerate(llm.llm_engine.processor.process("r", PROMPTS[0], _params()[0]).children):
        core.add_request(req)
    while core.has_unfinished_requests():
        core.step()
    assert modes and all(modes), f"sampling ran outside inference mode in {modes.count(False)} of {len(modes)} steps"
    assert sum(len(o.new_token_ids) for o in emitted) == 12
