"""The CPU kernels of AWQ / GPTQ / compressed-tensors weight-only linears (``wna16_gemm``) and of W8A8 linears
(``int8_gemm``): decoded weights bit for bit as the torch path rounds them, 4/8-bit products within float32
rounding of ``x @ W.T``, int8 products equal to ``torch._int_mm``, and the errors bad input gets."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.cpu import int8_gemm, wna16_gemm
from pagedllm.layers.quantization.unpack import pack_int32

pytestmark = pytest.mark.skipif(not (wna16_gemm.available() and int8_gemm.available()),
                                reason="the CPU kernels do not build here (no compiler or no AVX2)")


def _weights(bits: int, group: int, k: int, n: int, seed: int):
    """Packed rows [N, K / pack], scales and zeros [N, G], and the torch path's dequantized weight [N, K]."""
    gen = torch.Generator().manual_seed(seed)
    g = -(-k // group)
    q = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scales = torch.rand(n, g, generator=gen) * 0.02 - 0.005  # some negative, as some formats store
    zeros = torch.randint(0, 1 << bits, (n, g), generator=gen).float()
    rows = pack_int32(q.t().contiguous(), bits, 0).t().contiguous()  # value i of word j: input pack * j + i
    idx = torch.arange(k) // group
    return rows, scales, zeros, (q - zeros[:, idx]).float() * scales[:, idx]


@pytest.mark.parametrize("bits,group,k,n", [
    (4, 128, 512, 40),  # groups of whole eight-word vectors: one scale a vector
    (4, 32, 256, 24),  # four words a group: scales per lane
    (4, 56, 448, 16),  # a group that no vector boundary follows
    (8, 64, 256, 33),
    (8, 256, 256, 8),  # one group a row (per channel)
])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 16, 17])  # the kernel's row tiles of 4, 2, 1; past 16 the decoded weight
def test_wna16_products_and_decodes(bits, group, k, n, m):
    rows, scales, zeros, w = _weights(bits, group, k, n, seed=bits * k + n + m)
    assert torch.equal(wna16_gemm.wna16_decode(rows, scales, zeros, bits, group), w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = wna16_gemm.wna16_mm(x, rows, scales, zeros, bits, group)
    want = x.double() @ w.double().t()
    bound = 2e-6 * (x.abs().double() @ w.abs().double().t()) + 1e-12  # float32 sums in another order
    assert got.shape == (m, n) and ((got.double() - want).abs() <= bound).all()


def test_wna16_results_do_not_depend_on_the_thread_count():
    rows, scales, zeros, _ = _weights(4, 128, 1024, 512, seed=5)
    x = torch.randn(2, 1024)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = wna16_gemm.wna16_mm(x, rows, scales, zeros, 4, 128)
        torch.set_num_threads(2)
        two = wna16_gemm.wna16_mm(x, rows, scales, zeros, 4, 128)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_wna16_refuses_what_it_does_not_read():
    rows, scales, zeros, _ = _weights(4, 128, 256, 16, seed=1)
    with pytest.raises(ValueError, match="bits 2 is not one of"):
        wna16_gemm.wna16_mm(torch.randn(1, 256), rows, scales, zeros, 2, 128)
    with pytest.raises(ValueError, match=r"x: torch.float32 \(1, 128\).*\[M, 256\]"):
        wna16_gemm.wna16_mm(torch.randn(1, 128), rows, scales, zeros, 4, 128)
    with pytest.raises(ValueError, match=r"scales: torch.float16 .*\[16, 2\]"):
        wna16_gemm.wna16_mm(torch.randn(1, 256), rows, scales.half(), zeros, 4, 128)
    with pytest.raises(ValueError, match="K=96 inputs in groups of 32 at 4 bits"):
        wna16_gemm.wna16_decode(rows[:, :12].contiguous(), scales[:, :3].contiguous(), zeros[:, :3].contiguous(), 4, 32)
    assert not wna16_gemm.supports(4, 128, 96) and not wna16_gemm.supports(4, 4, 256) and wna16_gemm.supports(8, 4, 32)


@pytest.mark.parametrize("m,k,n", [(1, 640, 2048), (3, 100, 37), (16, 1024, 64), (70, 48, 24)])
def test_int8_product_equals_torchs(m, k, n):
    gen = torch.Generator().manual_seed(m + k + n)
    xq = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
    wq = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    xq[0], wq[0] = -128, -128  # the largest sums: no lane may saturate
    assert torch.equal(int8_gemm.int8_mm(xq, wq), xq.int() @ wq.int().t())
    assert int8_gemm.int8_mm(xq, wq)[0, 0] == k * 128 * 128


def test_int8_refuses_other_operands():
    with pytest.raises(ValueError, match=r"xq: torch.float32"):
        int8_gemm.int8_mm(torch.zeros(1, 8), torch.zeros(4, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="wq: 16 inputs a row for xq's 8"):
        int8_gemm.int8_mm(torch.zeros(1, 8, dtype=torch.int8), torch.zeros(4, 16, dtype=torch.int8))


@pytest.mark.parametrize("m,k", [(1, 640), (5, 2048), (16, 100)])
def test_int8_row_quantizer_and_epilogue_are_the_torch_arithmetic(m, k):
    """Bit for bit ``quantize_int8_rows``' symmetric scales and values (a row of zeros, ties at half steps, the
    clamp at -128) and the torch epilogue ``acc.float() * xs * ws``."""
    from pagedllm.kernels.int8_quant import quantize_int8_rows

    gen = torch.Generator().manual_seed(m * k)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m).unsqueeze(1)
    x[0, :4] = torch.tensor([2.5, -2.5, 127.5, -127.5])  # with max |x| = 127.5 the scale is 1: ties to even
    x[0, 4:] = x[0, 4:].clamp(-127.5, 127.5)
    if m > 1:
        x[1] = 0.0
    q, xs = int8_gemm.quantize_rows(x)
    q_ref, xs_ref, _ = quantize_int8_rows(x, symmetric=True)
    assert torch.equal(q, q_ref) and torch.equal(xs, xs_ref)
    wq = torch.randint(-128, 128, (48, k), generator=gen, dtype=torch.int8)
    ws = torch.rand(48, 1, generator=gen) * 0.01
    acc = int8_gemm.int8_mm(q, wq)
    assert torch.equal(int8_gemm.scale_rows(acc, xs, ws), acc.float() * xs * ws.float().view(1, -1))
