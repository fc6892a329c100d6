"""The W8A8 int8 kernels (``kernels/int8_quant.py``) against the torch path of ``layers/quantization/int8.py``
under Triton's interpreter: the row quantizer and the product's epilogue agree bit for bit."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import int8_quant, launch
from pagedllm.layers.quantization.int8 import quantize_int8_rows, w8a8_linear


def _rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m)[:, None]  # rows of very different ranges
    x[0, : k // 3] = 0.5  # a run of equal values
    if m > 2:
        x[2] = 0.0  # a row of zeros takes the eps scale
    return x.to(dtype)


@pytest.mark.parametrize("whole_row_max", [16384, 512])  # rows read once; rows past 512 in two passes of 1024
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k", [(1, 64), (5, 1000), (3, 2500)])  # one block, a ragged block, several blocks
def test_row_quantizer_is_bit_exact(m, k, dtype, whole_row_max, monkeypatch):
    monkeypatch.setattr(launch, "WHOLE_ROW_MAX", whole_row_max)
    x = _rows(m, k, dtype, seed=m * k)
    q, s = int8_quant.quantize_rows(x)
    q_ref, s_ref, _ = quantize_int8_rows(x, symmetric=True)
    assert q.dtype == torch.int8 and s.shape == (m, 1)
    assert torch.equal(s, s_ref)
    assert torch.equal(q, q_ref)


def test_row_quantizer_rounds_ties_to_even():
    # 127.5 maps the row's largest magnitude to the range's edge; 0.5 and 2.5 steps are exact ties.
    x = torch.tensor([[127.5, 0.5, 1.5, 2.5, -0.5, -2.5, 3.49]])
    q, s = int8_quant.quantize_rows(x)
    assert s.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, 3]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_epilogue_matches_the_torch_product(dtype, bias):
    m, k, n = 6, 96, 200
    g = torch.Generator().manual_seed(7)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    ws = torch.rand(n, 1, generator=g) * 1e-2
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    xq, xs = int8_quant.quantize_rows(x)
    acc = torch._int_mm(xq, w.t())  # [M, N] int32; padded rows are ignored by the epilogue
    acc = torch.cat([acc, torch.full((3, n), 12345, dtype=torch.int32)])
    got = int8_quant.scale_rows(acc, xs, ws, b, dtype)
    assert torch.equal(got, w8a8_linear(x, w, ws, b, act_symmetric=True))


def _skewed_rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``_rows`` and rows an asymmetric quantizer meets: one all positive (zero point -128), one all negative
    (zero point 127), one off-centre by far more than its spread."""
    x = _rows(m, k, dtype, seed).float()
    if m > 1:
        x[1] = x[1].abs() + 0.25
    if m > 3:
        x[3] = -x[3].abs() - 2.0
    if m > 4:
        x[4] = 40.0 + 0.01 * x[4]
    return x.to(dtype)


@pytest.mark.parametrize("whole_row_max", [16384, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k", [(2, 64), (6, 1000), (5, 2500)])
def test_asymmetric_row_quantizer_is_bit_exact(m, k, dtype, whole_row_max, monkeypatch):
    monkeypatch.setattr(launch, "WHOLE_ROW_MAX", whole_row_max)
    x = _skewed_rows(m, k, dtype, seed=m + k)
    q, s, z = int8_quant.quantize_rows_with_zeros(x)
    q_ref, s_ref, z_ref = quantize_int8_rows(x, symmetric=False)
    assert q.dtype == torch.int8 and s.shape == z.shape == (m, 1)
    assert torch.equal(s, s_ref) and torch.equal(z, z_ref) and torch.equal(q, q_ref)
    assert z[1].item() == -128.0 and (m <= 3 or z[3].item() == 127.0)


@pytest.mark.parametrize("bias", [False, True])
def test_epilogue_takes_the_zero_points_off(bias):
    m, k, n = 6, 96, 200
    g = torch.Generator().manual_seed(8)
    x = _skewed_rows(m, k, torch.float16, seed=8)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    ws = torch.rand(n, 1, generator=g) * 1e-2
    b = (torch.randn(n, generator=g) * 0.1).half() if bias else None
    xq, xs, xz = int8_quant.quantize_rows_with_zeros(x)
    sums = w.sum(dim=1, dtype=torch.int32).float()
    got = int8_quant.scale_rows(torch._int_mm(xq, w.t()), xs, ws, b, torch.float16, xz, sums)
    assert torch.equal(got, w8a8_linear(x, w, ws, b, act_symmetric=False))
