"""The int8 W8A8 linear on a real GPU: the compiled row quantizer and epilogue give the torch path's bits, and
the product at decode row counts (padded for cuBLAS) and prompt row counts equals the exact int32 product."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import int8_quant
from pagedllm.layers.quantization.int8 import quantize_int8_rows, w8a8_linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(1, 4096), (37, 14336), (256, 4096)])
def test_row_quantizer_is_bit_exact(m, k, dtype):
    g = torch.Generator(device="cuda").manual_seed(m)
    x = (torch.randn(m, k, device="cuda", generator=g) * 3).to(dtype)
    q, s = int8_quant.quantize_rows(x)
    q_ref, s_ref, _ = quantize_int8_rows(x, symmetric=True)
    assert torch.equal(s, s_ref) and torch.equal(q, q_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 16, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_product_equals_the_exact_int32_product(m, dtype, bias):
    k, n = 4096, 6144
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = torch.randint(-128, 128, (n, k), device="cuda", generator=g, dtype=torch.int8)
    ws = torch.rand(n, 1, device="cuda", generator=g) * 1e-3
    b = (torch.randn(n, device="cuda", generator=g) * 0.1).to(dtype) if bias else None
    got = w8a8_linear(x, w, ws, b, act_symmetric=True)
    xq, xs, _ = quantize_int8_rows(x, symmetric=True)
    exact = (xq.double() @ w.double().t()).float()  # int32-exact in float64
    want = exact * xs * ws.view(1, -1)
    if b is not None:
        want = want + b.float()
    assert got.shape == (m, n) and got.dtype == dtype
    assert torch.equal(got, want.to(dtype))
