"""Int8 W8A8 experts in the grouped MoE kernel, under Triton's interpreter: stacked int8 rows with their scales, the
inputs of each product quantized per row, give the per-expert loop of ``w8a8_linear`` (the dense W8A8 product)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.moe import fused_experts
from pagedllm.kernels.moe.grouped_gemm import Int8ExpertWeights
from pagedllm.layers.fused_moe.reference import gated_activation, per_expert
from pagedllm.layers.quantization.int8 import quantize_int8_rows, w8a8_linear

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}


def _int8_experts(num: int, n: int, k: int, gen: torch.Generator, symmetric: bool) -> Int8ExpertWeights:
    q, scale, _ = quantize_int8_rows(torch.randn(num * n, k, generator=gen) * 0.1)
    make = Int8ExpertWeights if symmetric else Int8ExpertWeights.asymmetric
    return make(q.view(num, n, k), scale.view(num, n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,top_k,config,symmetric", [
    (5, 2, None, True),
    (1, 2, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=1, num_warps=4, num_stages=2), True),  # K steps: 32
    (9, 3, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=2), True),
    (7, 2, None, False),  # activations with a zero point per token
])
def test_int8_experts_match_the_per_expert_w8a8_products(dtype, tokens, top_k, config, symmetric):
    num, hidden, inter = 6, 96, 80  # neither a multiple of the tiles: masked edges
    gen = torch.Generator().manual_seed(tokens)
    w13, w2 = _int8_experts(num, 2 * inter, hidden, gen, symmetric), _int8_experts(num, hidden, inter, gen, symmetric)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype) + 0.5  # off-centre rows: zero points far from 0
    weights, ids = torch.rand(tokens, num, generator=gen).softmax(-1).topk(top_k)
    ids = ids.to(torch.int32)

    def expert(rows: torch.Tensor, e: int) -> torch.Tensor:  # [n, H] -> [n, H]
        h = gated_activation(w8a8_linear(rows, w13.weight[e], w13.scale[e][:, None], None, symmetric), "silu")
        return w8a8_linear(h, w2.weight[e], w2.scale[e][:, None], None, symmetric)

    got = fused_experts(x, w13, w2, weights, ids, config=config)
    torch.testing.assert_close(got, per_expert(x, weights, ids, num, expert), **TOL[dtype])


def test_asymmetric_int8_experts_refuse_rows_without_zero_points():
    from pagedllm.kernels.moe.grouped_gemm import grouped_gemm

    w = Int8ExpertWeights.asymmetric(torch.ones(2, 32, 32, dtype=torch.int8), torch.ones(2, 32))
    assert torch.equal(w.row_sums, torch.full((2, 32), 32.0))
    ids = torch.zeros(16, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="take rows with a zero point each"):
        grouped_gemm(torch.zeros(16, 32, dtype=torch.int8), w, torch.empty(16, 32), torch.ones(16), *ids, 1,
                     dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2), gated=False,
                     a_scale=torch.ones(16, 1))


def test_int8_experts_refuse_unquantized_rows():
    from pagedllm.kernels.moe.grouped_gemm import grouped_gemm

    w = Int8ExpertWeights(torch.zeros(2, 32, 32, dtype=torch.int8), torch.ones(2, 32))
    ids = torch.zeros(16, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="int8 experts take int8 rows"):
        grouped_gemm(torch.zeros(16, 32), w, torch.empty(16, 32), torch.ones(16), *ids, 1,
                     dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2), gated=False)
