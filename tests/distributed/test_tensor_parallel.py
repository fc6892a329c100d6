"""Tensor parallelism in real worker processes over gloo: the same tokens as one process, in float32."""
from __future__ import annotations

import pytest
from parallel_cases import generate, make_edge_model, prompts

from pagedllm import SamplingParams


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_tp2_greedy_tokens_equal_one_process(kind, tmp_path):
    path = make_edge_model(kind, tmp_path / kind)
    ids = prompts()
    assert generate(path, ids, tensor_parallel_size=2) == generate(path, ids)


def test_prefix_caching_chunked_prefill_preemption_and_n_under_tp2(tmp_path):
    # 16-token steps cut every long prompt into chunks; 14 blocks of 16 cannot hold all six requests'
    # two samples each at once, so some are preempted and recomputed; the shared prefix hits the cache.
    path = make_edge_model("llama", tmp_path / "llama")
    ids = prompts()
    params = SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True)
    kwargs = dict(max_num_batched_tokens=16, num_gpu_blocks_override=14, enable_prefix_caching=True)
    one = generate(path, ids, params, **kwargs)
    assert generate(path, ids, params, tensor_parallel_size=2, **kwargs) == one
    assert all(len(o) == 2 for o in one)
