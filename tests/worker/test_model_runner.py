"""ModelRunner start-up steps on CPU: the kernel warm-up writes no KV and changes no later output."""
from __future__ import annotations

import pytest
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams


@pytest.mark.parametrize("backend", ["torch_ref", "cpu"])
def test_kernel_warm_up_leaves_the_cache_and_outputs_alone(tmp_path, backend):
    path = make_tiny_model("qwen3", tmp_path / "m")
    kw = dict(model=path, skip_tokenizer_init=True, device="cpu", dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=1 << 22, attention_backend=backend)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 20, 41)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    expected = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, params, use_tqdm=False)]

    llm = LLM(**kw)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    for cache in runner.kv_caches:
        cache.fill_(0.5)  # known contents: the warm-up may read block 0 but must write nowhere
    runner.warm_up_kernels()
    assert all(bool((cache == 0.5).all()) for cache in runner.kv_caches)
    for cache in runner.kv_caches:
        cache.zero_()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


def test_plain_greedy_argmax_on_model_dtype_logits_matches_the_sampler(tmp_path):
    # bf16 logits go to argmax without a float32 copy on the plain-greedy path; asking for logprobs
    # sends the same batch through the sampler on float32 logits. The tokens must agree exactly.
    path = make_tiny_model("llama", tmp_path / "m")
    llm = LLM(model=path, skip_tokenizer_init=True, device="cpu", dtype="bfloat16", max_model_len=128,
              kv_cache_memory_bytes=1 << 22)
    prompts = [{"prompt_token_ids": list(range(7, 7 + n))} for n in (4, 19, 33)]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False)
    sampled = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False, logprobs=1)
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled, use_tqdm=False)]
    assert a == b


@pytest.mark.parametrize(("backend", "kind"), [("torch_ref", "qwen3"), ("cpu", "qwen3"), ("cpu", "gemma3")])
def test_never_written_cache_slots_are_never_read(tmp_path, backend, kind):
    # On the CPU the cache is allocated without zero-filling: a slot holds whatever the memory held
    # until a token is written there. NaN everywhere stands for the worst such memory; outputs must not
    # change (decode, chunked prefill, a prefix-cache hit and, for Gemma 3, the sliding window).
    path = make_tiny_model(kind, tmp_path / "m")
    kw = dict(model=path, skip_tokenizer_init=True, device="cpu", dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=1 << 22, attention_backend=backend, max_num_batched_tokens=32,
              enable_prefix_caching=True)
    shared = list(range(5, 5 + 40))
    prompts = [{"prompt_token_ids": ids} for ids in (shared[:3], shared + [7, 8], shared + [9], list(range(50, 61)))]
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, detokenize=False)

    results = []
    for poison in (0.0, float("nan")):
        llm = LLM(**kw)
        for cache in llm.llm_engine.engine_core.executor.worker.model_runner.kv_caches:
            cache.fill_(poison)
        first = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params, use_tqdm=False)]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts[1:], params, use_tqdm=False)]  # hits
        results.append((first, again))
    assert results[0] == results[1]
    assert results[0][0][1] == results[0][1][0]  # the prefix-cache hit reproduces the fresh prefill


def test_cpu_weights_are_packed_at_load_before_the_kv_cache_is_sized(tmp_path):
    # oneDNN reorders float32 weights once; doing it at load (not in the first step) lets the CPU KV
    # budget see the RAM the packed copies take. Other dtypes never use the packed copy: none is made.
    from pagedllm.layers import cpu_linear

    if not cpu_linear._ONEDNN_PACK:
        pytest.skip("this torch build has no oneDNN weight reorder")
    path = make_tiny_model("llama", tmp_path / "m")
    packed = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model=path, skip_tokenizer_init=True, device="cpu", dtype=dtype, max_model_len=64,
                  kv_cache_memory_bytes=1 << 20)
        model = llm.llm_engine.engine_core.executor.worker.model_runner.model
        holders = [m for m in model.modules() if isinstance(getattr(m, "packed_weight", None), cpu_linear.PackedWeight)]
        assert holders
        packed[dtype] = [m.packed_weight._packed is not None for m in holders]
    assert all(packed["float32"]) and not any(packed["bfloat16"])
