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

from pagedllm.kernel_launch import pdl_launch_args, wait_for_previous_kernel

FP8_MAX = 448.0  # the largest finite float8 e4m3fn value
# A row of zeros still gets a positive scale, so dequantization never divides by zero.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _quant_rows_kernel(
    x_ptr,  # [M, K], last dim contiguous
    q_ptr,  # [M, K] float8 e4m3fn, contiguous
    s_ptr,  # [M] float32 (stored as [M, 1])
    K,
    stride_xm,
    FP8_MAX_C: tl.constexpr,
    MIN_SCALE_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr,  # launched with PDL: wait for the previous kernel first (kernel_launch.py)
):
    wait_for_previous_kernel(USE_GDC, False)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # IEEE divisions (Triton's `/` on float32 is approximate), as torch divides.
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX_C), MIN_SCALE_C)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + cols < K
        x = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX_C), FP8_MAX_C)
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
    block_k = min(1024, triton.next_power_of_2(k))
    _quant_rows_kernel[(m,)](
        x, q, scales, k, x.stride(0),
        FP8_MAX_C=FP8_MAX,
        MIN_SCALE_C=MIN_SCALE,
        BLOCK_K=block_k,
        num_warps=4,
        **pdl_launch_args(x),
    )
    return q, scales
