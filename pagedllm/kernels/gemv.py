"""Triton matrix-vector product ``y = x @ W^T`` for one token: a batch-1 decode linear in one bandwidth-bound launch.

At one token a linear layer is a weight read: the time is the weight's bytes over HBM bandwidth. cuBLAS
answers the narrow shapes (an output of a few thousand rows over a long input) with split-K, which adds a
second, reduction kernel per product and its launch gap. Here each program owns ``BLOCK_N`` output rows,
walks the whole input dimension in ``BLOCK_K`` steps, and reduces once at the end: one launch, no partial
sums in memory, and a fixed summation order (run-to-run identical). Each thread first sums its ``FOLD``
neighbouring products of a step in registers, so that its float32 accumulator holds ``BLOCK_K / FOLD``
columns, not ``BLOCK_K``: the registers saved keep more programs, and so more weight bytes, in flight.
A float8 weight with one scale per output row (``--quantization fp8``) is read as is and each row's sum is
multiplied by its scale: half the bytes, and the 16-bit activation is not quantized.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.kernels.launch import pdl_launch_args

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# Products a thread sums before its accumulator. Against an element-wise accumulator, Llama-3-8B's batch-1
# step on an H200 went from 2.92 to 2.67 ms with float8 weights and from 4.17 to 4.09 ms in bf16.
FOLD = 16


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int  # a multiple of FOLD
    num_warps: int


@triton.jit
def _fold_add(acc, prod, FOLD: tl.constexpr):
    """acc [N, K / FOLD] + prod [N, K] summed over each FOLD neighbouring columns (one thread's own)."""
    acc += tl.sum(tl.reshape(prod, [prod.shape[0], prod.shape[1] // FOLD, FOLD]), axis=2)
    return acc


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
    FOLD: tl.constexpr,
    USE_GDC: tl.constexpr,  # launched with PDL: wait for the previous kernel first (kernels/launch.py)
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]; N % BLOCK_N == 0 (host checks)
    cols = tl.arange(0, BLOCK_K)  # [BLOCK_K]; K % BLOCK_K == 0
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]  # [BLOCK_N, BLOCK_K]
    # A [1, BLOCK_K] row broadcast over the tile, not a vector: it then takes the tile's own layout.
    x_ptrs = x_ptr + cols[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    k_first = 0
    if USE_GDC:
        # No kernel ever writes the weights, so the first tile is read before waiting for the previous
        # kernel (which writes x): that read overlaps the wait.
        w0 = tl.load(w_ptrs).to(tl.float32)
        tl.extra.cuda.gdc_wait()
        acc = _fold_add(acc, w0 * tl.load(x_ptrs).to(tl.float32), FOLD)
        k_first = BLOCK_K
    for k0 in range(k_first, K, BLOCK_K):
        x = tl.load(x_ptrs + k0).to(tl.float32)  # [1, BLOCK_K]
        w = tl.load(w_ptrs + k0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        acc = _fold_add(acc, w * x, FOLD)
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_SCALE:
        y *= tl.load(s_ptr + rows)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))


def default_config(n: int, k: int, float8: bool = False) -> GemvConfig | None:
    """Tile shape for an [n, k] weight (``float8``: stored in float8), or None when no tile divides it (the
    caller falls back).

    From H200 sweeps over the Llama-3-8B linears (a tile-sweep script kept in git history), with the products of
    16 columns folded: 2 rows by 2,048 columns for 16-bit weights; for float8 ones, which carry half the
    bytes a column, 16 x 512 on the tall gate_up, 8 x 1,024 on outputs wider than the input, 4 x 2,048 else.
    Narrower K steps where 2,048 does not divide the input.
    """
    if float8:
        block_n, block_k = (16, 512) if n >= 4 * k else (8, 1024) if n > k else (4, 2048)
    else:
        block_n, block_k = 2, 2048
    while k % block_k and block_k > 128:
        block_k //= 2
    if k % block_k:
        return None
    block_n = next((b for b in (block_n, 4, 8, 16, 2) if n % b == 0), None)
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
        and default_config(weight.shape[0], weight.shape[1], weight.dtype == torch.float8_e4m3fn) is not None
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
    cfg = config or default_config(n, k, weight.dtype == torch.float8_e4m3fn)
    assert cfg is not None and n % cfg.block_n == 0 and k % cfg.block_k == 0, (n, k, cfg)
    assert cfg.block_k % FOLD == 0, cfg
    x = x.contiguous()
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(n // cfg.block_n,)](
        x, weight, bias if bias is not None else y, scale if scale is not None else y, y,
        k, weight.stride(0),
        HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        FOLD=FOLD,
        num_warps=cfg.num_warps,
        **pdl_launch_args(x),
    )
    return y
