"""Triton kernels around the int8 W8A8 product: activations quantized per row in one launch, and the int32
product scaled back to the activation dtype in one launch.

Written as torch ops, a W8A8 linear's activation quantization is eight launches over [T, K] (cast, min, max,
scale, divide, clamp, round, cast) and its epilogue four over [T, N]; a decode step runs a few hundred
products, and those launches cost more than the products themselves at small batches. The arithmetic is
``layers/quantization/int8.py``'s (``quantize_int8_rows`` below, ``w8a8_linear``), symmetric or with a zero point
per row, IEEE division and round-half-to-even, so the two agree bit for bit. The torch arithmetic itself
(``int8_qparams``, ``quantize_int8_rows``) lives here too: it is these kernels' reference, and the path of rows
the kernels do not take.
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
RANGE = tl.constexpr(255.0)  # QMAX - QMIN: an asymmetric row's span maps here
INV_RANGE = tl.constexpr(float(torch.tensor(1.0) / torch.tensor(255.0)))
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
def row_params(lo, hi, EXACT: tl.constexpr, RECIPROCAL: tl.constexpr):
    """(scale, zero point) of asymmetric rows whose smallest and largest values are ``lo`` and ``hi`` (float32),
    as ``int8_qparams`` computes them: the range widened to hold zero, its span over 255, and the zero point
    ``round(clamp(-128 - lo / scale))``, each op rounded as torch's."""
    lo = tl.minimum(lo, 0.0)
    span = add_rn(tl.maximum(hi, 0.0), -lo, EXACT)
    if RECIPROCAL:
        scale = mul_rn(span, INV_RANGE, EXACT)
    else:
        scale = tl.math.div_rn(span, RANGE)
    scale = tl.where(scale == 0.0, EPS, scale)
    zero = add_rn(-128.0, -tl.math.div_rn(lo, scale), EXACT)
    return scale, _round_half_even(tl.minimum(tl.maximum(zero, -128.0), 127.0), EXACT)


@triton.jit
def quantize_int8_zero(x, scale, zero, EXACT: tl.constexpr):
    """float32 ``x`` over its row's ``scale`` plus its ``zero`` point, clamped and rounded half to even, as int8."""
    v = add_rn(tl.math.div_rn(x, scale), zero, EXACT)
    return _round_half_even(tl.minimum(tl.maximum(v, -128.0), 127.0), EXACT).to(tl.int8)


@triton.jit
def _quant_rows_kernel(
    x_ptr,  # [M, K], last dim contiguous
    q_ptr,  # [M, K] int8, contiguous
    s_ptr,  # [M] float32 (stored as [M, 1])
    z_ptr,  # [M] float32 zero points (ZERO_POINTS only)
    K,
    stride_xm,
    BLOCK_K: tl.constexpr,
    WHOLE_ROW: tl.constexpr,  # BLOCK_K >= K: the row is read once (launch.row_tile)
    EXACT: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    ZERO_POINTS: tl.constexpr,  # asymmetric rows: a zero point each (else symmetric)
    USE_GDC: tl.constexpr,  # launched with PDL: wait for the previous kernel first (kernels/launch.py)
):
    wait_for_previous_kernel(USE_GDC, False)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    # Masked entries load as 0, which the range holds anyway: they change neither max |x| nor [min, max].
    if WHOLE_ROW:
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if ZERO_POINTS:
            scale, zero = row_params(tl.min(x, axis=0), tl.max(x, axis=0), EXACT, RECIPROCAL)
            tl.store(z_ptr + row, zero)
            q = quantize_int8_zero(x, scale, zero, EXACT)
        else:
            scale = row_scale(tl.max(tl.abs(x), axis=0), EXACT, RECIPROCAL)
            q = quantize_int8(x, scale, EXACT)
        tl.store(s_ptr + row, scale)
        tl.store(q_ptr + row * K + cols, q, mask=mask)
    else:
        lo = tl.zeros([BLOCK_K], dtype=tl.float32)
        hi = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            lo = tl.minimum(lo, x)
            hi = tl.maximum(hi, x)
        if ZERO_POINTS:
            scale, zero = row_params(tl.min(lo, axis=0), tl.max(hi, axis=0), EXACT, RECIPROCAL)
            tl.store(z_ptr + row, zero)
        else:
            scale = row_scale(tl.maximum(-tl.min(lo, axis=0), tl.max(hi, axis=0)), EXACT, RECIPROCAL)
            zero = 0.0
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + cols < K
            x = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
            if ZERO_POINTS:
                q = quantize_int8_zero(x, scale, zero, EXACT)
            else:
                q = quantize_int8(x, scale, EXACT)
            tl.store(q_ptr + row * K + k0 + cols, q, mask=mask)


@triton.jit
def scaled_sums(acc, xs, ws, xz, row_sums, EXACT: tl.constexpr, ZERO_POINTS: tl.constexpr):
    """float32 outputs of exact int32 sums ``acc`` [R, C]: with activation zero points ``xz`` [R, 1], first
    ``acc - xz * row_sums`` (the weight rows' sums [1, C]), then times the row scales ``xs`` [R, 1] and the column
    scales ``ws`` [1, C]; each op rounded as ``w8a8_linear``'s torch ops round it."""
    y = acc.to(tl.float32)
    if ZERO_POINTS:
        y = add_rn(y, -mul_rn(xz, row_sums, EXACT), EXACT)
    return mul_rn(mul_rn(y, xs, EXACT), ws, EXACT)


@triton.jit
def _scale_rows_kernel(
    acc_ptr,  # [M, N] int32 (rows may be longer than M: a padded product), last dim contiguous
    xs_ptr,  # [M] float32
    ws_ptr,  # [N] float32
    xz_ptr,  # [M] float32 activation zero points (ZERO_POINTS only)
    rs_ptr,  # [N] float32 sums of the weight rows (ZERO_POINTS only)
    b_ptr,  # [N] bias, or any pointer without HAS_BIAS
    out_ptr,  # [M, N] activation dtype, contiguous
    N,
    stride_am,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EXACT: tl.constexpr,
    ZERO_POINTS: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_previous_kernel(USE_GDC, False)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    acc = tl.load(acc_ptr + row * stride_am + cols, mask=mask, other=0)
    xz = tl.load(xz_ptr + row) if ZERO_POINTS else 0.0
    row_sums = tl.load(rs_ptr + cols, mask=mask, other=0.0) if ZERO_POINTS else 0.0
    y = scaled_sums(acc, tl.load(xs_ptr + row), tl.load(ws_ptr + cols, mask=mask, other=0.0), xz, row_sums, EXACT,
                    ZERO_POINTS)
    if HAS_BIAS:
        y = add_rn(y, tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32), EXACT)
    tl.store(out_ptr + row * N + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def usable(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.is_cuda and x.dtype in SUPPORTED_DTYPES and x.stride(-1) == 1


def _quantize(x: torch.Tensor, zero_points: bool):  # x [M, K] -> q [M, K] int8, scales and zeros [M, 1] float32
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    zeros = torch.empty((m, 1), dtype=torch.float32, device=x.device) if zero_points else None
    if m == 0:
        return q, scales, zeros
    block_k, whole_row, warps = row_tile(k)
    _quant_rows_kernel[(m,)](
        x, q, scales, zeros if zero_points else scales, k, x.stride(0),
        BLOCK_K=block_k, WHOLE_ROW=whole_row, EXACT=exact_rounding(x), RECIPROCAL=exact_rounding(x),
        ZERO_POINTS=zero_points, num_warps=warps, **pdl_launch_args(x),
    )
    return q, scales, zeros


def quantize_rows(
    x: torch.Tensor,  # [M, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # q [M, K] int8, scales [M, 1] float32
    """Symmetric int8 rows: scale = max|x| / 127.5 (float32 eps for a row of zeros), q = round(x / scale)
    clamped to [-128, 127]."""
    q, scales, _ = _quantize(x, False)
    return q, scales


def quantize_rows_with_zeros(
    x: torch.Tensor,  # [M, K]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [M, K] int8, scales [M, 1], zero points [M, 1] float32
    """Asymmetric int8 rows, ``quantize_int8_rows(x, symmetric=False)`` in one launch: the range [min, max] widened
    to hold zero, scale = its span / 255, zero point = round(-128 - min / scale), q = round(x / scale + zero)
    clamped to [-128, 127]."""
    return _quantize(x, True)


def scale_rows(
    acc: torch.Tensor,  # [M' >= M, N] int32 (a padded product's first M rows are used)
    x_scales: torch.Tensor,  # [M, 1] float32
    w_scales: torch.Tensor,  # [N, 1] or [N] float32
    bias: torch.Tensor | None,  # [N]
    dtype: torch.dtype,
    x_zeros: torch.Tensor | None = None,  # [M, 1] float32: zero points of asymmetric rows
    w_row_sums: torch.Tensor | None = None,  # [N] float32: the int8 weight rows' sums (with x_zeros)
) -> torch.Tensor:  # [M, N] in dtype
    """``(acc - x_zero[m] * w_row_sum[n]) * x_scale[m] * w_scale[n] (+ bias[n])`` in float32, rounded to ``dtype``:
    the product's epilogue."""
    m, n = x_scales.shape[0], acc.shape[1]
    out = torch.empty((m, n), dtype=dtype, device=acc.device)
    if m == 0:
        return out
    block_n = min(1024, triton.next_power_of_2(n))
    zp = x_zeros is not None
    _scale_rows_kernel[(m, triton.cdiv(n, block_n))](
        acc, x_scales, w_scales.reshape(-1).float(), x_zeros if zp else acc, w_row_sums if zp else acc,
        bias if bias is not None else acc, out, n, acc.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, EXACT=exact_rounding(acc), ZERO_POINTS=zp, num_warps=4,
        **pdl_launch_args(acc),
    )
    return out
