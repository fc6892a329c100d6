"""Triton matrix-vector product ``y = x @ W^T`` for one token: a batch-1 decode linear in one bandwidth-bound launch.

At one token a linear layer is a weight read: the time is the weight's bytes over HBM bandwidth. cuBLAS
answers the narrow shapes (an output of a few thousand rows over a long input) with split-K, which adds a
second, reduction kernel per product and its launch gap. Here each program owns ``BLOCK_N`` output rows,
walks the whole input dimension in ``BLOCK_K`` steps with an fp32 element-wise accumulator, and reduces
once at the end: one launch, no partial sums in memory, and a fixed summation order (run-to-run identical).
A float8 weight with one scale per output row (``--quantization fp8``) is read as is and each row's sum is
multiplied by its scale: half the bytes, and the 16-bit activation is not quantized.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.kernel_launch import pdl_launch_args

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K] contiguous
    w_ptr,  # [N, K], last dim contiguous
    b_ptr,  # [N] (read only when HAS_BIAS)
    s_ptr,  # [N] float32 weight row scales (read only when HAS_SCALE)
    y_ptr,  # [N] contiguous
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr,  # launched with PDL: wait for the previous kernel first (kernel_launch.py)
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]; N % BLOCK_N == 0 (host checks)
    cols = tl.arange(0, BLOCK_K)  # [BLOCK_K]; K % BLOCK_K == 0
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_first = 0
    if USE_GDC:
        # No kernel ever writes the weights, so the first tile is read before waiting for the previous
        # kernel (which writes x): that read overlaps the wait.
        w0 = tl.load(w_ptrs).to(tl.float32)
        tl.extra.cuda.gdc_wait()
        acc += w0 * tl.load(x_ptr + cols).to(tl.float32)[None, :]
        k_first = BLOCK_K
    for k0 in range(k_first, K, BLOCK_K):
        x = tl.load(x_ptr + k0 + cols).to(tl.float32)  # [BLOCK_K]
        w = tl.load(w_ptrs + k0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_SCALE:
        y *= tl.load(s_ptr + rows)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))


def default_config(n: int, k: int) -> GemvConfig | None:
    """Tile shape for an [n, k] weight, or None when no tile divides it (the caller falls back).

    From an H200 sweep over the Llama-3-8B and Qwen3-0.6B linears (bf16): 1024-wide K steps win
    everywhere; 4-row programs win except on 4096-row outputs over a 4096+ input, where 8 rows do.
    """
    block_k = next((b for b in (1024, 512, 256, 128) if k % b == 0), None)
    if block_k is None:
        return None
    preferred = (8, 4, 16) if n <= 4096 and k >= 4096 else (4, 8, 16)
    block_n = next((b for b in preferred if n % b == 0), None)
    return GemvConfig(block_n, block_k, 4) if block_n is not None else None


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One token on CUDA in a half type, a contiguous weight in that type or in float8 e4m3, and shapes a
    tile divides."""
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.is_cuda
        and x.dtype in SUPPORTED_DTYPES
        and weight.dtype in (x.dtype, torch.float8_e4m3fn)
        and weight.stride(-1) == 1
        and default_config(weight.shape[0], weight.shape[1]) is not None
    )


def gemv(
    x: torch.Tensor,  # [1, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    config: GemvConfig | None = None,
    scale: torch.Tensor | None = None,  # [N] float32 row scales of a float8 weight
) -> torch.Tensor:  # [1, N]
    n, k = weight.shape
    assert (scale is not None) == (weight.dtype == torch.float8_e4m3fn), "a float8 weight needs its row scales"
    cfg = config or default_config(n, k)
    assert cfg is not None and n % cfg.block_n == 0 and k % cfg.block_k == 0, (n, k, cfg)
    x = x.contiguous()
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(n // cfg.block_n,)](
        x, weight, bias if bias is not None else y, scale if scale is not None else y, y,
        k, weight.stride(0),
        HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        **pdl_launch_args(x),
    )
    return y
