"""Triton per-row float8 quantization of activations: one launch gives the float8 rows and their scales.

An fp8 linear multiplies float8 activations by float8 weights on the tensor cores, with one float32
scale per activation row (token) and one per weight row. The rows of a step's activations are
quantized here just before the product: each program reads its row twice (the second pass from L2),
once for the largest magnitude and once to divide and round. Written as torch ops the same work is
five launches a product; at a decode step's few hundred products that is a visible share of the step.
The arithmetic is ``layers.quantization.fp8.quantize_rows_ref``'s, so the two agree bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.launch import pdl_launch_args, row_tile, wait_for_previous_kernel

FP8_MAX = 448.0  # the largest finite float8 e4m3fn value
# A row of zeros still gets a positive scale, so dequantization never divides by zero.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# The same two numbers as the kernels see them.
FP8_MAX_K = tl.constexpr(FP8_MAX)
MIN_SCALE_K = tl.constexpr(MIN_SCALE)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def row_scale(amax):
    """A row's scale from its largest magnitude. IEEE divisions throughout (Triton's `/` on float32 is
    approximate), as torch divides two tensors."""
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX_K), MIN_SCALE_K)


@triton.jit
def to_fp8_range(x, scale):
    """``x / scale`` clamped to the float8 range, ready for the rounding cast to float8."""
    return tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX_K), FP8_MAX_K)


@triton.jit
def _quant_rows_kernel(
    x_ptr,  # [M, K], last dim contiguous
    q_ptr,  # [M, K] float8 e4m3fn, contiguous
    s_ptr,  # [M] float32 (stored as [M, 1])
    K,
    stride_xm,
    BLOCK_K: tl.constexpr,
    WHOLE_ROW: tl.constexpr,  # BLOCK_K >= K: the row is read once (launch.row_tile)
    USE_GDC: tl.constexpr,  # launched with PDL: wait for the previous kernel first (kernels/launch.py)
):
    wait_for_previous_kernel(USE_GDC, False)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    x_row = x_ptr + row * stride_xm
    if WHOLE_ROW:
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(x), axis=0))
        tl.store(s_ptr + row, scale)
        tl.store(q_ptr + row * K + cols, to_fp8_range(x, scale).to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = row_scale(tl.max(amax, axis=0))
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + cols < K
            x = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
            q = to_fp8_range(x, scale)
            tl.store(q_ptr + row * K + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def usable(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.is_cuda and x.dtype in SUPPORTED_DTYPES and x.stride(-1) == 1


def quantize_rows(
    x: torch.Tensor,  # [M, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # q [M, K] float8_e4m3fn, scales [M, 1] float32
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scales
    block_k, whole_row, warps = row_tile(k)
    _quant_rows_kernel[(m,)](
        x, q, scales, k, x.stride(0),
        BLOCK_K=block_k,
        WHOLE_ROW=whole_row,
        num_warps=warps,
        **pdl_launch_args(x),
    )
    return q, scales
