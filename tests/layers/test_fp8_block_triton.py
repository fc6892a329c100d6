"""Block-wise float8 products (``kernels/fp8_block.py``) under Triton's interpreter against the torch path of
``Fp8BlockLinearMethod``: the activation groups' float8 values and scales bit for bit, and the product over
shapes whose edges cut blocks, with and without quantized activations, with a bias, in float32 and float16."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.kernels.fp8_block import fp8_block_linear, quantize_groups, usable
from pagedllm.layers.quantization.fp8_block import FP8_DTYPE, Fp8BlockLinearMethod, fp8_group_quant_dequant


def _exact_groups(rows: int, k: int, group: int, gen: torch.Generator) -> torch.Tensor:  # [rows, k] float32
    """Activations whose group quantization rounds nothing: float8 values times a power-of-two scale per group,
    each group reaching +-448 once (Triton's interpreter rounds float32 to float8 unlike the GPU next to a power
    of two and below the normal range; tests/gpu checks the rounding itself)."""
    groups = -(-k // group)
    q = (torch.randn(rows, groups * group, generator=gen) * 60).clamp(-448, 448).to(FP8_DTYPE).float()
    q.view(rows, groups, group)[:, :, 0] = 448.0
    scales = 2.0 ** torch.randint(-12, -4, (rows, groups, 1), generator=gen).float()
    return (q.view(rows, groups, group) * scales).view(rows, -1)[:, :k].contiguous()


@pytest.mark.parametrize("rows,k,group", [(3, 256, 128), (1, 100, 32), (5, 64, 64)])
def test_activation_groups_equal_the_torch_rounding(rows, k, group):
    x = _exact_groups(rows, k, group, torch.Generator().manual_seed(k))
    x[0, :group] = 0.0  # a zero group keeps a positive scale
    q, s = quantize_groups(x, group)
    deq = (q.float().view(rows, -1) * s.repeat_interleave(group, dim=1)[:, :k])
    assert torch.equal(deq, fp8_group_quant_dequant(x, group))
    assert s[0, 0] == torch.finfo(torch.float32).eps
    q_t, s_t = quantize_groups(x, group, rows_minor=True)  # cuBLAS's column-major scales: the same values
    assert s_t.stride() == (1, rows) and torch.equal(s_t, s) and torch.equal(q_t.float(), q.float())


def _layer(n: int, k: int, block: tuple[int, int], gen: torch.Generator, bias: bool) -> nn.Module:
    bn, bk = block
    layer = nn.Module()
    layer.weight = nn.Parameter((torch.randn(n, k, generator=gen) * 200).to(FP8_DTYPE), requires_grad=False)
    layer.weight_scale_inv = nn.Parameter(torch.rand(-(-n // bn), -(-k // bk), generator=gen) * 1e-3 + 1e-4,
                                          requires_grad=False)
    layer.bias = torch.randn(n, generator=gen) if bias else None
    return layer


# Relative to the largest output: float32 sums in another order (blocks scaled before they are added), and float16
# outputs rounded once.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,block,quantize_acts,bias", [
    (1, 96, 256, (128, 128), True, False),  # N ends inside a block row
    (5, 128, 200, (128, 128), True, True),  # K ends inside a block
    (33, 80, 128, (64, 64), True, False),  # several row tiles, 64-input blocks
    (4, 64, 96, (32, 32), False, True),  # activations kept in their type
])
def test_block_product_matches_the_torch_path(dtype, m, n, k, block, quantize_acts, bias):
    gen = torch.Generator().manual_seed(m * n + k)
    layer = _layer(n, k, block, gen, bias)
    method = Fp8BlockLinearMethod(block, "weight_scale_inv", block[1] if quantize_acts else None)
    x = (_exact_groups(m, k, block[1], gen) if quantize_acts else torch.randn(m, k, generator=gen)).to(dtype)
    assert usable(x, block, method.act_group)
    got = fp8_block_linear(x, layer.weight, layer.weight_scale_inv, block, method.act_group,
                           None if layer.bias is None else layer.bias.to(dtype))
    want = method.torch_apply(layer, x, None if layer.bias is None else layer.bias.to(dtype))
    assert got.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)


def test_blocks_the_kernel_does_not_take_stay_on_the_torch_path():
    x = torch.zeros(2, 256)
    assert not usable(x, (128, 96), 96)  # not a power of two
    assert not usable(x, (128, 128), 64)  # activation groups shorter than a block
    with pytest.raises(ValueError, match=r"weight \(64, 256\) with scales \(1, 1\) does not fit 256 inputs"):
        fp8_block_linear(x, torch.zeros(64, 256, dtype=FP8_DTYPE), torch.ones(1, 1), (128, 128), 128)
