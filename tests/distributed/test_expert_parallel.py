"""MoE models across worker processes over gloo: experts split by rows (tensor parallel) or whole experts per
rank with tokens sent by all-to-all (expert parallel), each giving one process's greedy tokens in float32."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from parallel_cases import generate, prompts
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.parallel_state import destroy_model_parallel, get_ep_group, init_model_parallel
from pagedllm.layers.fused_moe import fused_experts_ref, select_experts
from pagedllm.layers.fused_moe.expert_parallel import expert_parallel_experts

# Three layers (PP=2 splits them 2/1); top-2 of 8 (Mixtral), top-1 of 8 with a shared expert (Qwen2-MoE), top-8
# of 16 (Qwen3-MoE).
SHAPES = {kind: dict(num_hidden_layers=3, vocab_size=383) for kind in ("mixtral", "qwen2_moe", "qwen3_moe")}


def _layer_case(tokens: int):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 24, generator=g)
    w13, w2 = torch.randn(8, 2 * 16, 24, generator=g), torch.randn(8, 24, 16, generator=g)
    logits = torch.randn(tokens, 8, generator=g)
    if tokens > 4:
        logits[:4, 5] = 9.0  # some tokens agree on an expert; expert 7 may get none
    weights, ids = select_experts(logits, 3, renormalize=True)
    return x, w13, w2, weights, ids


def _ep_rank(rank: int, port: int, results) -> None:
    init_model_parallel(2, 1, rank, f"tcp://127.0.0.1:{port}", enable_expert_parallel=True)
    try:
        group = get_ep_group()
        assert group.world_size == 2
        for tokens in (0, 1, 2, 7, 33):
            x, w13, w2, weights, ids = _layer_case(tokens)
            local = slice(4 * rank, 4 * rank + 4)

            def run(rows, w, local_ids):
                return fused_experts_ref(rows, w13[local], w2[local], w, local_ids)

            got = expert_parallel_experts(x, weights, ids, group, 4, run)
            results[(rank, tokens)] = torch.equal(got, fused_experts_ref(x, w13, w2, weights, ids))
    finally:
        destroy_model_parallel()


def test_all_to_all_experts_equal_the_reference_bit_for_bit():
    # Two ranks of four experts each, 0 to 33 tokens (fewer tokens than ranks too): every rank's result equals the
    # one-process reference exactly, since each expert sees the same rows in the same order and each token sums
    # its experts lowest id first.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_ep_rank, args=(port, results), nprocs=2)
    assert dict(results) == {(r, t): True for r in range(2) for t in (0, 1, 2, 7, 33)}


@pytest.mark.slow  # three kinds x (one process, TP=2, EP=2): minutes on 2 cores
@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_tp2_and_ep2_greedy_tokens_equal_one_process(kind, tmp_path):
    path = make_tiny_model(kind, tmp_path / kind, **SHAPES[kind])
    ids = prompts()
    one = generate(path, ids)
    assert generate(path, ids, tensor_parallel_size=2) == one
    assert generate(path, ids, tensor_parallel_size=2, enable_expert_parallel=True) == one


def test_ep2_with_chunked_prefill_and_preemption(tmp_path):
    # 16-token steps chunk the long prompts; 14 blocks cannot hold every request at once (preemption); steps of
    # a few decode tokens leave an expert-parallel rank with no token of its own to route.
    path = make_tiny_model("qwen3_moe", tmp_path / "m", **SHAPES["qwen3_moe"])
    ids = prompts()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kwargs = dict(max_num_batched_tokens=16, num_gpu_blocks_override=14, enable_prefix_caching=True)
    one = generate(path, ids, params, **kwargs)
    assert generate(path, ids, params, tensor_parallel_size=2, enable_expert_parallel=True, **kwargs) == one


@pytest.mark.slow  # four worker processes
def test_ep2_within_two_pipeline_stages(tmp_path):
    path = make_tiny_model("mixtral", tmp_path / "m", **SHAPES["mixtral"])
    ids = prompts()
    assert generate(path, ids, tensor_parallel_size=2, pipeline_parallel_size=2,
                    enable_expert_parallel=True) == generate(path, ids)


def test_experts_not_divisible_by_ranks_is_refused_before_loading(tmp_path):
    path = make_tiny_model("mixtral", tmp_path / "m", num_hidden_layers=1, num_local_experts=3, vocab_size=383)
    with pytest.raises(ValueError, match="3 experts are not divisible by tensor_parallel_size 2"):
        LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, tensor_parallel_size=2,
            enable_expert_parallel=True)
