"""The GGUF products with int8 activations (kernels/cpu/gguf_q8_gemm.c) against the same arithmetic in float64:
x quantized to signed bytes per group of 32 exactly as the kernel defines it, then multiplied by the decoded
weights; only float32 rounding may differ. Also how far that lands from the float32 product."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize  # noqa: E402
from test_gguf_cpu_gemm import TYPES, _k, _weight  # noqa: E402

from pagedllm.kernels.cpu import gguf_gemm as gg  # noqa: E402

# Byte offset of the f16 dmin of Q4_K / Q5_K blocks: zeroed, the decode gives a * q, the part of each weight
# that meets the quantized x (the min term meets the exact x).
DMIN = {T.Q4_K: 2, T.Q5_K: 2}
RTOL = 2e-6

pytestmark = pytest.mark.skipif(not gg.available() or gg._q8_library() is None, reason="kernels not built here")


def quantized_x(x: torch.Tensor) -> torch.Tensor:  # [M, K] float32 -> [M, K] float64, each group's bytes * scale
    """x as the kernel rounds it: per group of 32, d = max|x| / 127 and q = round(x * (1 / d)), in float32."""
    g = x.reshape(x.shape[0], -1, 32)
    d = g.abs().amax(-1, keepdim=True) / torch.tensor(127.0)
    inv = torch.where(d > 0, torch.tensor(1.0) / d, torch.zeros_like(d))
    q = torch.round(g * inv)
    assert q.abs().max() <= 127
    return (q.double() * d.double()).reshape(x.shape)


def weights(raw: np.ndarray, qtype: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoded weights W and the part a * (q - o) of each (W without Q4_K / Q5_K's min), float64."""
    w = torch.from_numpy(dequantize(raw, T(qtype)).astype(np.float32)).double()
    if qtype not in DMIN:
        return w, w
    block, size = gg.BLOCKS[qtype]
    blocks = raw.reshape(raw.shape[0], -1, size).copy()
    blocks[..., DMIN[qtype]:DMIN[qtype] + 2] = 0
    return w, torch.from_numpy(dequantize(blocks.reshape(raw.shape[0], -1), T(qtype)).astype(np.float32)).double()


@pytest.mark.parametrize("qtype", TYPES, ids=[gg.TYPE_NAMES[t] for t in TYPES])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
def test_int8_activation_product_equals_its_definition(qtype, m):
    n, k = 37, _k(qtype)
    raw = _weight(qtype, n, k, seed=m)
    w, scaled = weights(raw, qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.linspace(0.1, 4, k)
    x[0, :32] = 0  # a group of zeros: scale 0, no division by it
    xq = quantized_x(x)
    y = gg.gguf_mm(x, torch.from_numpy(raw), qtype, int8_activations=True)
    assert y.dtype == torch.float32 and tuple(y.shape) == (m, n)
    exact = xq @ scaled.t() - x.double() @ (scaled - w).t()
    bound = RTOL * (xq.abs() @ scaled.abs().t() + x.double().abs() @ (scaled - w).abs().t()) + 1e-30
    assert ((y.double() - exact).abs() <= bound).all(), float(((y.double() - exact).abs() / bound).max())
    # And near the float32 product: the bytes' rounding moves each output by well under 1% of its scale.
    dense = x.double() @ w.t()
    assert ((y.double() - dense).norm() / dense.norm()) < 2e-2


def test_more_rows_than_the_integer_path_takes_stay_float32():
    raw = torch.from_numpy(_weight(T.Q8_0, 19, 64))
    x = torch.randn(gg.Q8_MAX_ROWS + 1, 64)
    assert torch.equal(gg.gguf_mm(x, raw, T.Q8_0, int8_activations=True), gg.gguf_mm(x, raw, T.Q8_0))


def test_int8_activations_do_not_depend_on_the_thread_count():
    raw = torch.from_numpy(_weight(T.Q6_K, 301, 512))
    x = torch.randn(3, 512)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gg.gguf_mm(x, raw, T.Q6_K, int8_activations=True)
        torch.set_num_threads(2)
        two = gg.gguf_mm(x, raw, T.Q6_K, int8_activations=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
