"""The int8 W8A8 linear on a real GPU: the compiled row quantizer and epilogue give the torch path's bits, the
product at decode row counts and prompt row counts equals the exact int32 product, and the fused decode kernel
(``kernels/int8_gemm.py``) gives the bits of the quantizer + cuBLAS + epilogue launches it replaces."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import int8_gemm, int8_quant
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
@pytest.mark.parametrize("m", [1, 7, 16, 17, 256, 300, 600])  # decode, cuBLAS, tiles
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


def _decode_case(m: int, k: int, n: int, dtype: torch.dtype, bias: bool):
    g = torch.Generator(device="cuda").manual_seed(m * 7 + k)
    x = (torch.randn(m, k, device="cuda", generator=g) * torch.logspace(-3, 2, m, device="cuda")[:, None]).to(dtype)
    if m > 2:
        x[2] = 0.0  # a row of zeros: the eps scale
    w = torch.randint(-128, 128, (n, k), device="cuda", generator=g, dtype=torch.int8)
    ws = torch.rand(n, 1, device="cuda", generator=g) * 1e-3
    b = (torch.randn(n, device="cuda", generator=g) * 0.1).to(dtype) if bias else None
    return x, w, ws, b


def _four_launches(x, w, ws, b):  # the path the fused kernel replaces: quantizer, padded cuBLAS product, epilogue
    xq, xs = int8_quant.quantize_rows(x)
    acc = torch._int_mm(F.pad(xq, (0, 0, 0, 32 - xq.shape[0])), w.t())  # cuBLAS takes more than 16 rows
    return int8_quant.scale_rows(acc, xs, ws, b, x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 16])
@pytest.mark.parametrize("k,n", [(4096, 6144), (14336, 4096)])  # Llama-3-8B's qkv and down
@pytest.mark.parametrize("bias", [False, True])
def test_decode_kernel_equals_the_four_launches(m, k, n, dtype, bias):
    x, w, ws, b = _decode_case(m, k, n, dtype, bias)
    assert int8_gemm.usable(x, w)
    want = _four_launches(x, w, ws, b)
    got = int8_gemm.w8a8_decode(x, w, ws, b)
    assert got.shape == (m, n) and got.dtype == dtype
    assert torch.equal(got, want)
    assert torch.equal(w8a8_linear(x, w, ws, b, act_symmetric=True), want)  # the linear takes it


@pytest.mark.parametrize("m", [1, 7, 16])
@pytest.mark.parametrize(
    "tile",
    [
        {"block_m": 16},  # one full mma tile of rows, whatever M
        {"block_n": 32, "block_k": 128},
        {"block_n": 64, "block_k": 512, "num_warps": 8},
        {"block_n": 16, "block_k": 32, "num_stages": 1},  # the int8 dot's shortest K
        {"early_launch": True},
    ],
)
def test_decode_kernel_tiles_give_the_same_bits(m, tile):
    # Every tile a later sweep may pick, on a ragged shape too (K, N no multiples of the tile).
    for k, n in ((4096, 6144), (1000, 100)):
        x, w, ws, b = _decode_case(m, k, n, torch.bfloat16, bias=True)
        xq, xs, _ = quantize_int8_rows(x, symmetric=True)
        exact = (xq.double() @ w.double().t()).float()  # int32-exact in float64
        want = (exact * xs * ws.view(1, -1) + b.float()).to(x.dtype)
        assert torch.equal(int8_gemm.w8a8_decode(x, w, ws, b, **tile), want)


@pytest.mark.parametrize(
    "cfg",
    [
        int8_gemm.TileConfig(256, 128, 128, 8, 3, 1),
        int8_gemm.TileConfig(256, 128, 128, 8, 3, 4),  # K in 4 programs a tile, summed by the last to finish
        int8_gemm.TileConfig(128, 64, 128, 4, 4, 2),
        int8_gemm.TileConfig(64, 256, 64, 8, 3, 3),
    ],
)
def test_row_tiles_give_the_exact_product(cfg):
    # The tiles a sweep may pick at prompt and full-batch row counts, ragged shapes included, and a second launch
    # after the first (the split counts left at zero).
    for m, k, n in ((256, 14336, 4096), (300, 1000, 100)):
        x, w, ws, b = _decode_case(m, k, n, torch.bfloat16, bias=True)
        xq, xs, _ = quantize_int8_rows(x, symmetric=True)
        exact = (xq.double() @ w.double().t()).float()  # int32-exact in float64
        want = (exact * xs * ws.view(1, -1) + b.float()).to(x.dtype)
        for _ in range(2):
            assert torch.equal(int8_gemm.w8a8_tiles(x, w, ws, b, config=cfg), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_producer_kernels_store_the_quantizer_rows(dtype):
    # Compiled: int8's scale through the reciprocal, as torch on CUDA divides by a scalar (row_quant.scale_of).
    from pagedllm.kernels import activation, rmsnorm

    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(37, 4096, device="cuda", generator=g) * 3).to(dtype)
    res = torch.randn(37, 4096, device="cuda", generator=g).to(dtype)
    w = (torch.randn(4096, device="cuda", generator=g) * 0.1 + 1).to(dtype)
    plain, _ = rmsnorm.rms_norm(x, w, 1e-5, res)
    fused, _ = rmsnorm.rms_norm(x, w, 1e-5, res, quantize="int8")
    q, s = int8_quant.quantize_rows(plain)
    assert torch.equal(fused.q, q) and torch.equal(fused.scales, s)
    gate_up = (torch.randn(37, 2 * 14336, device="cuda", generator=g) * 2).to(dtype)
    fused = activation.act_and_mul(gate_up, "silu", quantize="int8")
    q, s = int8_quant.quantize_rows(activation.act_and_mul(gate_up, "silu"))
    assert torch.equal(fused.q, q) and torch.equal(fused.scales, s)


@pytest.mark.parametrize("m", [1, 7, 30, 256])  # decode kernel, cuBLAS between, tiles
def test_every_path_takes_producer_rows(m):
    from pagedllm.kernels.row_quant import QuantizedRows

    x, w, ws, b = _decode_case(m, 14336, 4096, torch.bfloat16, bias=True)
    rows = QuantizedRows(*int8_quant.quantize_rows(x), x.dtype)
    assert torch.equal(w8a8_linear(rows, w, ws, b, act_symmetric=True), w8a8_linear(x, w, ws, b, act_symmetric=True))
    if m == 1:  # down's K split over programs, from the producer's row
        assert torch.equal(int8_gemm.w8a8_decode(rows, w, ws, b, split_k=4), w8a8_linear(x, w, ws, b, True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(1, 4096), (37, 14336), (256, 4096)])
def test_asymmetric_row_quantizer_is_bit_exact(m, k, dtype):
    g = torch.Generator(device="cuda").manual_seed(m + 1)
    x = (torch.randn(m, k, device="cuda", generator=g) * 3 + torch.linspace(-4, 6, m, device="cuda")[:, None]).to(dtype)
    q, s, z = int8_quant.quantize_rows_with_zeros(x)
    q_ref, s_ref, z_ref = quantize_int8_rows(x, symmetric=False)
    assert torch.equal(s, s_ref) and torch.equal(z, z_ref) and torch.equal(q, q_ref)


@pytest.mark.parametrize("m", [1, 7, 30, 256])  # decode kernel, decode kernel, cuBLAS between, tiles
def test_asymmetric_rows_take_every_path(m):
    x, w, ws, b = _decode_case(m, 14336, 4096, torch.bfloat16, bias=True)
    x = x + 0.5  # off-centre rows: zero points away from 0
    sums = w.sum(dim=1, dtype=torch.int32).float()
    want = w8a8_linear(x, w, ws, b, act_symmetric=False)  # torch's ops: no row sums given
    assert torch.equal(w8a8_linear(x, w, ws, b, act_symmetric=False, row_sums=sums), want)

