"""A KV cache smaller than one sequence of max_model_len: start-up stops with the capacity and the length that fits."""
from __future__ import annotations

import pytest
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams

# The tiny qwen3 in float32: 2 layers x (K, V) x 2 KV heads x head_dim 32 x 4 bytes = 1,024 bytes a token,
# so 16 KiB a block of 16 tokens.
_BLOCK_BYTES = 16 * 1024


def _llm(path, **kw):
    return LLM(model=path, skip_tokenizer_init=True, max_num_seqs=2, seed=0, device="cpu", dtype="float32", **kw)


@pytest.mark.parametrize("budget", [
    {"kv_cache_memory_bytes": 3 * _BLOCK_BYTES + _BLOCK_BYTES // 2},  # half a block more is not a block
    {"num_gpu_blocks_override": 3},
])
def test_too_small_a_cache_names_its_capacity_and_the_longest_length_that_fits(tmp_path, budget):
    path = make_tiny_model("qwen3", tmp_path / "qwen3")
    with pytest.raises(ValueError, match=r"holds 48 tokens \(3 blocks of 16\), fewer than one sequence of "
                                         r"max_model_len 128; lower max_model_len to at most 48"):
        _llm(path, max_model_len=128, **budget)
    # The length it names works: a request of all 48 tokens runs in those 3 blocks.
    llm = _llm(path, max_model_len=48, **budget)
    assert llm.llm_engine.engine_core.num_blocks == 3
    out = llm.generate([{"prompt_token_ids": list(range(3, 43))}],
                       SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
