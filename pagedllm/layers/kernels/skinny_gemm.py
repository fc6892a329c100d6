"""Triton product ``y = x @ W^T`` for a few to a few hundred tokens: small output tiles so that narrow layers fill the GPU.

A decode batch of a small model multiplies 16-256 rows by weights of a few thousand outputs. cuBLAS
answers with 128-wide tiles: an output of 1024 features then keeps 8-32 of 132 SMs busy and the product
is latency-bound. Here the tile is chosen per shape (``GemmConfig``) down to 16 x 32, every program walks
the whole input dimension (no split-K, no second kernel), and the summation order is fixed.
Opt in with ``PAGEDLLM_TRITON_GEMM=1`` (bf16/fp16 on CUDA); everything else stays on cuBLAS.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.kernel_launch import pdl_launch_args, wait_for_previous_kernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# Rows above this go to cuBLAS, whose large tiles are the right ones there.
MAX_ROWS = 256


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # [M, K], last dim contiguous
    w_ptr,  # [N, K], last dim contiguous
    b_ptr,  # [N] (read only when HAS_BIAS)
    y_ptr,  # [M, N] contiguous
    M,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr,  # launched with PDL: wait for the previous kernel first (kernel_launch.py)
):
    wait_for_previous_kernel(USE_GDC, False)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]; N % BLOCK_N == 0 (host checks)
    ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]; K % BLOCK_K == 0
    row_in = rows < M
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N]: W^T tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(x_ptrs + k0, mask=row_in[:, None], other=0.0)
        b = tl.load(w_ptrs + k0)
        acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_in[:, None])


def enabled() -> bool:
    return os.environ.get("PAGEDLLM_TRITON_GEMM", "0") == "1"


def default_config(m: int, n: int, k: int) -> GemmConfig | None:
    """A tile for an [m, k] x [n, k]^T product, or None when no tile divides the weight.

    Rows: the smallest tensor-core tile holding them, up to 64. Columns: narrow enough that the
    grid has about two programs per SM. K steps of 64 or 128 with a 3-stage pipeline.
    """
    block_k = next((b for b in (128, 64, 32) if k % b == 0), None)
    if block_k is None or m > MAX_ROWS:
        return None
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    row_blocks = triton.cdiv(m, block_m)
    block_n = next((b for b in (128, 64, 32) if n % b == 0 and row_blocks * (n // b) >= 256), None)
    if block_n is None:
        block_n = next((b for b in (32, 64, 128) if n % b == 0), None)
    if block_n is None:
        return None
    return GemmConfig(block_m, block_n, block_k, 4, 3)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dim() == 2
        and x.is_cuda
        and 1 < x.shape[0] <= MAX_ROWS
        and x.dtype in SUPPORTED_DTYPES
        and weight.dtype == x.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and default_config(x.shape[0], weight.shape[0], weight.shape[1]) is not None
    )


def skinny_gemm(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    config: GemmConfig | None = None,
) -> torch.Tensor:  # [M, N]
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or default_config(m, n, k)
    assert cfg is not None and n % cfg.block_n == 0 and k % cfg.block_k == 0, (m, n, k, cfg)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), n // cfg.block_n)
    _skinny_gemm_kernel[grid](
        x, weight, bias if bias is not None else y, y,
        m, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch_args(x),
    )
    return y
