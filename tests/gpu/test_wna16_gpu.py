"""The W4A16/W8A16 Triton kernel on a real GPU against the torch unpack oracle in bfloat16 and float16, at decode,
small-chunk and prompt row counts over Llama-3-8B projection shapes."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.wna16 import wna16_matmul
from pagedllm.layers.quantization import wna16_layout as layout
from pagedllm.layers.quantization.unpack import gptq_dequantize, pack_int32

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gptq(k: int, n: int, bits: int, group: int, act_order: bool, gen: torch.Generator):
    groups = k // group
    q = torch.randint(0, 1 << bits, (k, n), generator=gen)
    z = torch.randint(0, (1 << bits) - 1, (groups, n), generator=gen)
    s = torch.rand(groups, n, generator=gen) * 0.01 + 0.002
    g_idx = (torch.arange(k) // group).int()
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)].contiguous()
    return pack_int32(q, bits, 0), pack_int32(z, bits, 1), s, g_idx


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize("k,n,bits,group,act_order", [
    (4096, 14336, 4, 128, False), (14336, 4096, 4, 128, True), (4096, 6144, 8, 64, False), (4096, 4096, 4, 32, True)])
def test_kernel_matches_oracle(dtype, m, k, n, bits, group, act_order):
    gen = torch.Generator().manual_seed(m + k)
    qw, qz, s, g_idx = _gptq(k, n, bits, group, act_order, gen)
    oracle = gptq_dequantize(qw, qz, s, g_idx, bits, 1)  # [N, K] float32 on the CPU
    w = layout.from_gptq(qw.cuda(), qz.cuda(), s.to(dtype).cuda(), g_idx.cuda() if act_order else None, bits,
                         group, 1)
    x = torch.randn(m, k, generator=gen).to(dtype)
    want = (x.cuda().float() @ gptq_dequantize(qw, qz, s.to(dtype), g_idx, bits, 1).to(dtype).float().cuda().t())
    xk = x.cuda().index_select(1, w.perm) if w.perm is not None else x.cuda()
    got = wna16_matmul(xk, w.qweight, w.scales, w.zeros, w.bits, w.group_size, w.g_idx).float()
    assert oracle.shape == (n, k)
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= 2e-2 * scale, (err, scale)
