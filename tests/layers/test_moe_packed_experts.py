"""Packed 4/8-bit experts (AWQ, GPTQ, compressed-tensors W4A16/W8A16) in the grouped MoE kernel, under Triton's
interpreter: stacked from each expert's common packed layout (act-order permutations undone into a group index per
row), they give the per-expert reference over the same dequantized weights; and a quantized MoE model whose experts
are restacked in place keeps its greedy tokens and logprobs."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.moe import fused_experts
from pagedllm.kernels.moe.grouped_gemm import PackedExpertWeights
from pagedllm.layers.fused_moe import fused_experts_ref
from pagedllm.layers.quantization.unpack import pack_int32
from pagedllm.layers.quantization.wna16_layout import WNA16Weights, from_gptq, stack_experts

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}


def _projection(n: int, k: int, bits: int, group: int, act_order: bool, gen: torch.Generator,
                dtype: torch.dtype) -> WNA16Weights:
    """A random GPTQ projection of ``n`` outputs and ``k`` inputs in the common layout (``from_gptq``)."""
    top = 1 << bits
    g = k if group == -1 else group
    groups = k // g
    q = torch.randint(0, top, (k, n), generator=gen, dtype=torch.int32)
    zeros = torch.randint(0, top, (groups, n), generator=gen, dtype=torch.int32)
    scales = ((torch.rand(groups, n, generator=gen) * 0.02 + 0.005) * 16 / top).to(dtype)  # weights below ~0.4
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // g)[torch.randperm(k, generator=gen)].to(torch.int32)
    return from_gptq(pack_int32(q, bits, 0), pack_int32(zeros, bits, 1), scales, g_idx, bits, group, 0)


def _experts(num: int, hidden: int, inter: int, bits: int, group: int, act_order: bool, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = [[_projection(inter, hidden, bits, group, act_order, gen, dtype) for _ in range(2)] for _ in range(num)]
    w2 = [[_projection(hidden, inter, bits, group, act_order, gen, dtype)] for _ in range(num)]
    dense13 = torch.stack([torch.cat([w.dequantize() for w in ex]) for ex in w13]).to(dtype)  # [E, 2I, H]
    dense2 = torch.stack([ex[0].dequantize() for ex in w2]).to(dtype)  # [E, H, I]
    return stack_experts(w13), stack_experts(w2), dense13, dense2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits,group,act_order,tokens,top_k,config", [
    (4, 16, False, 5, 2, None),  # groups shorter than a tile: a scale row per input row
    (4, 32, False, 1, 2, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)),  # one group a tile
    (4, 16, True, 9, 2, None),  # act-order: a group index per row, each projection its own
    (8, -1, False, 7, 1, None),  # 8-bit, one group for all inputs
    (8, 16, True, 3, 4, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2)),
])
def test_packed_experts_match_their_dequantized_reference(dtype, bits, group, act_order, tokens, top_k, config):
    num, hidden, inter = 6, 64, 96  # inter not a multiple of the 64-column tiles: masked edges
    w13, w2, dense13, dense2 = _experts(num, hidden, inter, bits, group, act_order, dtype, seed=bits * 100 + tokens)
    assert (w13.g_idx is not None) == act_order and w13.shape == (num, 2 * inter, hidden)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights, ids = torch.rand(tokens, num, generator=gen).softmax(-1).topk(top_k)
    ids = ids.to(torch.int32)
    got = fused_experts(x, w13, w2, weights, ids, config=config)
    want = fused_experts_ref(x, dense13, dense2, weights, ids, "silu")
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_stacking_refuses_experts_of_different_widths():
    gen = torch.Generator().manual_seed(0)
    a = _projection(16, 32, 4, 16, False, gen, torch.float32)
    b = _projection(16, 32, 8, 16, False, gen, torch.float32)
    with pytest.raises(ValueError, match="expert 1: 8-bit weights in 2 groups; expert 0 has 4-bit in 2"):
        stack_experts([[a], [b]])


def test_packed_weights_state_their_stacked_shape():
    gen = torch.Generator().manual_seed(1)
    w = stack_experts([[_projection(24, 64, 4, 32, False, gen, torch.float32)] for _ in range(3)])
    assert isinstance(w, PackedExpertWeights) and w.shape == (3, 24, 64) and w.qweight.shape == (3, 8, 24)


@pytest.mark.parametrize("tokens,config", [
    (1, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)),
    (9, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2)),
])
def test_pairs_dequantization_of_experts_is_the_two_step_weight(tokens, config, monkeypatch):
    """4-bit experts dequantized two values an instruction (``_pairs_tile``, as on NVIDIA GPUs), here with the PTX's
    arithmetic as Triton ops under the interpreter: the same bits as the two-step path, so the same outputs."""
    from pagedllm.kernels.moe import grouped_gemm as gg

    w13, w2, _, _ = _experts(6, 64, 96, 4, 32, False, torch.float16, seed=tokens)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=gen).half()
    weights, ids = torch.rand(tokens, 6, generator=gen).softmax(-1).topk(2)
    two_step = fused_experts(x, w13, w2, weights, ids.to(torch.int32), config=config)
    monkeypatch.setattr(gg, "pairs_apply", lambda a, bits: bits == 4)
    assert torch.equal(fused_experts(x, w13, w2, weights, ids.to(torch.int32), config=config), two_step)
