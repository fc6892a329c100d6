"""End-to-end parity: pagedllm's greedy tokens and logprobs equal HF transformers' in float32, per architecture."""
from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams

KINDS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe"]
MAX_NEW = 12
NUM_LOGPROBS = 5


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    shared = torch.randint(3, vocab, (33,), generator=g).tolist()
    lens = [3, 15, 16, 17, 41]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    # Two prompts share two full blocks and a bit: prefix-cache hits inside one batch.
    prompts += [shared + [5, 6, 7], shared + [9]]
    return prompts


@pytest.fixture(scope="module", params=KINDS)
def model_case(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size)
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        ids = out.sequences[0, len(p):].tolist()
        lps = [torch.log_softmax(l[0].float(), -1) for l in out.logits]
        expected.append((ids, lps))
    return request.param, path, prompts, expected


def _run(path: str, prompts, **engine_kwargs):
    llm = LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=NUM_LOGPROBS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outs


def _check(outs, expected, kind: str) -> None:
    for i, (out, (ids, lps)) in enumerate(zip(outs, expected)):
        got = out.outputs[0]
        assert got.token_ids == ids, f"{kind}: prompt {i} differs from HF"
        assert got.finish_reason == "length"
        for pos, (tok, d) in enumerate(zip(got.token_ids, got.logprobs)):
            ref = lps[pos]
            assert abs(d[tok].logprob - ref[tok].item()) < 1e-3, (kind, i, pos)
            top = torch.topk(ref, NUM_LOGPROBS).indices.tolist()
            # Close in check_logprobs_close's sense: every returned top token carries HF's logprob.
            for t in top[:3]:
                assert t in d and abs(d[t].logprob - ref[t].item()) < 1e-3, (kind, i, pos, t)


def test_greedy_matches_hf(model_case):
    kind, path, prompts, expected = model_case
    llm, outs = _run(path, prompts, kv_cache_memory_bytes=1 << 24)
    _check(outs, expected, kind)
    # The two prompts sharing 33 tokens: the later one reuses two full blocks.
    assert outs[-1].num_cached_tokens == 32 or outs[-2].num_cached_tokens == 32


def test_prefix_caching_off_and_chunked_prefill(model_case):
    kind, path, prompts, expected = model_case
    _, outs = _run(path, prompts, kv_cache_memory_bytes=1 << 24, enable_prefix_caching=False)
    _check(outs, expected, kind)
    # A budget of 8 tokens forces every prompt longer than 8 into chunks.
    _, outs = _run(path, prompts, kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=8)
    _check(outs, expected, kind)


def test_preemption_keeps_outputs(model_case):
    kind, path, prompts, expected = model_case
    llm = LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=64,
              num_gpu_blocks_override=6)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=NUM_LOGPROBS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    _check(outs, expected, kind)
    pool = llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
