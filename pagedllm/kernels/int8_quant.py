"""Triton kernels around the int8 W8A8 product: activations quantized per row in one launch, and the int32
product scaled back to the activation dtype in one launch.

Written as torch ops, a W8A8 linear's activation quantization is eight launches over [T, K] (cast, min, max,
scale, divide, clamp, round, cast) and its epilogue four over [T, N]; a decode step runs a few hundred
products, and those launches cost more than the products themselves at small batches. The arithmetic is
``layers/quantization/int8.py``'s symmetric path (``quantize_int8_rows`` below, ``w8a8_linear``), IEEE division and
round-half-to-even, so the two agree bit for bit. The torch arithmetic itself (``int8_qparams``,
``quantize_int8_rows``, symmetric or with a zero point per row) lives here too: it is these kernels' reference,
and the MoE kernels quantize asymmetric rows with it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.launch import pdl_launch_args, row_tile, wait_for_previous_kernel
from pagedllm.kernels.numerics import add_rn, exact_rounding, mul_rn

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HALF_RANGE = tl.constexpr(127.5)  # (QMAX - QMIN) / 2: a symmetric row's largest magnitude maps here
INV_HALF_RANGE = tl.constexpr(float(torch.tensor(1.0) / torch.tensor(127.5)))  # its float32 reciprocal
EPS = tl.constexpr(torch.finfo(torch.float32).eps)  # the scale of a row of zeros
QMIN, QMAX = -128, 127
_EPS = torch.finfo(torch.float32).eps  # EPS for torch


def int8_qparams(
    x: torch.Tensor,  # [M, K]
    symmetric: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # scales [M, 1] float32, zero points [M, 1] float32 or None
    """Per-row scale (and zero point) of compressed-tensors' arithmetic: the range always holds zero."""
    xf = x.float()
    lo = xf.amin(dim=-1, keepdim=True).clamp(max=0)
    hi = xf.amax(dim=-1, keepdim=True).clamp(min=0)
    if symmetric:
        scale = torch.maximum(lo.abs(), hi) / ((QMAX - QMIN) / 2)
        return torch.where(scale == 0, torch.full_like(scale, _EPS), scale), None
    scale = (hi - lo) / (QMAX - QMIN)
    scale = torch.where(scale == 0, torch.full_like(scale, _EPS), scale)
    zero = torch.round((QMIN - lo / scale).clamp(QMIN, QMAX))
    return scale, zero


def quantize_int8_rows(
    x: torch.Tensor,  # [M, K]
    symmetric: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # q [M, K] int8, scales [M, 1], zero points [M, 1]
    scale, zero = int8_qparams(x, symmetric)
    scaled = x.float() / scale
    if zero is not None:
        scaled = scaled + zero
    return torch.round(scaled.clamp(QMIN, QMAX)).to(torch.int8), scale, zero


@triton.jit
def _round_half_even(v, EXACT: tl.constexpr):
    """``v`` (already in [-128, 127]) rounded to an integer, ties to even as torch.round: adding and removing
    1.5 * 2**23 leaves no fraction bits in float32's round-to-nearest-even; explicit round-to-nearest adds keep
    the compiler from folding the pair away, and the interpreter runs them as they are."""
    big = 12582912.0
    return add_rn(add_rn(v, big, EXACT), -big, EXACT)


@triton.jit
def row_scale(amax, EXACT: tl.constexpr, RECIPROCAL: tl.constexpr):
    """The symmetric scale of rows whose largest magnitude is ``amax`` (float32, a scalar or one per row);
    shared with ``int8_gemm.py``'s fused product, which must compute the same scales."""
    if RECIPROCAL:  # torch on CUDA divides by a scalar as a product with its float32 reciprocal
        scale = mul_rn(amax, INV_HALF_RANGE, EXACT)
    else:
        scale = tl.math.div_rn(amax, HALF_RANGE)
    return tl.where(scale == 0.0, EPS, scale)


@triton.jit
def quantize_int8(x, scale, EXACT: tl.constexpr):
    """float32 ``x`` over its row's ``scale`` (broadcast to x's shape), clamped to [-128, 127] and rounded
    half to even, as int8: ``quantize_int8_rows``'s arithmetic (IEEE division, as torch divides by a tensor)."""
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -128.0), 127.0)
    return _round_half_even(v, EXACT).to(tl.int8)


@triton.jit
def _quant_rows_kernel(
    x_ptr,  # [M, K], last dim contiguous
    q_ptr,  # [M, K] int8, contiguous
    s_ptr,  # [M] float32 (stored as [M, 1])
    K,
    stride_xm,
    BLOCK_K: tl.constexpr,
    WHOLE_ROW: tl.constexpr,  # BLOCK_K >= K: the row is read once (launch.row_tile)
    EXACT: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    USE_GDC: tl.constexpr,  # launched with PDL: wait for the previous kernel first (kernels/launch.py)
):
    wait_for_previous_kernel(USE_GDC, False)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    if WHOLE_ROW:
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(x), axis=0), EXACT, RECIPROCAL)
        tl.store(s_ptr + row, scale)
        tl.store(q_ptr + row * K + cols, quantize_int8(x, scale, EXACT), mask=mask)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = row_scale(tl.max(amax, axis=0), EXACT, RECIPROCAL)
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + cols < K
            x = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * K + k0 + cols, quantize_int8(x, scale, EXACT), mask=mask)


@triton.jit
def _scale_rows_kernel(
    acc_ptr,  # [M, N] int32 (rows may be longer than M: a padded product), last dim contiguous
    xs_ptr,  # [M] float32
    ws_ptr,  # [N] float32
    b_ptr,  # [N] bias, or any pointer without HAS_BIAS
    out_ptr,  # [M, N] activation dtype, contiguous
    N,
    stride_am,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EXACT: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_previous_kernel(USE_GDC, False)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    acc = tl.load(acc_ptr + row * stride_am + cols, mask=mask, other=0).to(tl.float32)
    y = mul_rn(mul_rn(acc, tl.load(xs_ptr + row), EXACT), tl.load(ws_ptr + cols, mask=mask, other=0.0), EXACT)
    if HAS_BIAS:
        y = add_rn(y, tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32), EXACT)
    tl.store(out_ptr + row * N + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def usable(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.is_cuda and x.dtype in SUPPORTED_DTYPES and x.stride(-1) == 1


def quantize_rows(
    x: torch.Tensor,  # [M, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # q [M, K] int8, scales [M, 1] float32
    """Symmetric int8 rows: scale = max|x| / 127.5 (float32 eps for a row of zeros), q = round(x / scale)
    clamped to [-128, 127]."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scales
    block_k, whole_row, warps = row_tile(k)
    _quant_rows_kernel[(m,)](
        x, q, scales, k, x.stride(0),
        BLOCK_K=block_k, WHOLE_ROW=whole_row, EXACT=exact_rounding(x), RECIPROCAL=exact_rounding(x),
        num_warps=warps, **pdl_launch_args(x),
    )
    return q, scales


def scale_rows(
    acc: torch.Tensor,  # [M' >= M, N] int32 (a padded product's first M rows are used)
    x_scales: torch.Tensor,  # [M, 1] float32
    w_scales: torch.Tensor,  # [N, 1] or [N] float32
    bias: torch.Tensor | None,  # [N]
    dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] in dtype
    """``acc * x_scale[m] * w_scale[n] (+ bias[n])`` in float32, rounded to ``dtype``: the product's epilogue."""
    m, n = x_scales.shape[0], acc.shape[1]
    out = torch.empty((m, n), dtype=dtype, device=acc.device)
    if m == 0:
        return out
    block_n = min(1024, triton.next_power_of_2(n))
    _scale_rows_kernel[(m, triton.cdiv(n, block_n))](
        acc, x_scales, w_scales.reshape(-1).float(), bias if bias is not None else acc, out, n, acc.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, EXACT=exact_rounding(acc), num_warps=4, **pdl_launch_args(acc),
    )
    return out
