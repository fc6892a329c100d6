"""Triton product ``y = (x @ W^T) * scale`` of 2-64 tokens and a float8 weight with row scales (``--quantization fp8``).

The weight tile is widened to the activation's type (exactly: every e4m3 value is a bf16 and an fp16
value) and each output column scaled at the end: half the weight bytes, with the 16-bit activation
kept, as the one-token GEMV does (``quantization/fp8.py`` says which products come here). The tile is
chosen per shape (``GemmConfig``) down to 16 x 32, and the input dimension can be split over
``split_k`` programs per tile. A split tile is summed in the same launch: each program stores its
float32 partial, and the last of a tile to arrive (counted with an atomic) adds the partials in split
order, so the result does not depend on which program finished last. Swapped tiles
(``GemmConfig.swap_ab``) put the weight rows on the tensor cores' 64-row side, so that a handful of
tokens wastes none of it. Products of 16-bit weights stay on cuBLAS: through these tiles workload 1
ran at 0.912x on an H200 (docs/performance.md).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.kernels.launch import pdl_launch_args, wait_for_previous_kernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
EARLY_LAUNCH_MAX_ROWS = 16
# Rows above this quantize their tokens for cuBLAS's float8 product instead (quantization/fp8.py).
MAX_ROWS = 64
# Per device, shared by every split launch (one stream runs them one after another): float32 partials
# and one arrival counter per output tile, zero between launches (the last program of a tile resets it).
WORKSPACE_FLOATS = 4 << 20
MAX_TILES = 1 << 14
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs sharing one output tile, each over K / split_k of the input dimension
    # The weight tile [block_n, block_k] as the product's left operand and the tokens as its right: the
    # tensor cores' 64-row side then runs over weight rows, not over a handful of tokens, and a float8
    # tile widened in registers feeds them from there (Hopper) instead of another trip through shared memory.
    swap_ab: bool = False


@triton.jit
def _store_tile(acc, b_ptr, s_ptr, y_ptr, rows, cols, row_in, stride_ym, HAS_BIAS: tl.constexpr):
    acc *= tl.load(s_ptr + cols)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_in[:, None])


@triton.jit
def _mma(w, x, acc, SWAP_AB: tl.constexpr):
    """acc += the tile product: w [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, BLOCK_M] when swapped, else
    x [BLOCK_M, BLOCK_K] @ W^T [BLOCK_K, BLOCK_N]."""
    if SWAP_AB:
        acc = tl.dot(w, x, acc)
    else:
        acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # [M, K], last dim contiguous
    w_ptr,  # [N, K] float8, last dim contiguous
    b_ptr,  # [N] (read only when HAS_BIAS)
    s_ptr,  # [N] float32 row scales of the weight
    y_ptr,  # [M, N] contiguous
    part_ptr,  # [SPLIT_K, grid_m * BLOCK_M, N] float32 partials (read only when SPLIT_K > 1)
    count_ptr,  # [grid_m * grid_n] int32 arrivals per output tile, zero on entry and on exit
    M,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_GDC: tl.constexpr,  # launched with PDL: wait for the previous kernel first (kernels/launch.py)
    EARLY_LAUNCH: tl.constexpr,  # (USE_GDC) let the next kernel launch as soon as this one has waited
    SWAP_AB: tl.constexpr,  # GemmConfig.swap_ab
):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]; N % BLOCK_N == 0 (host checks)
    k_len = K // SPLIT_K  # a multiple of BLOCK_K (host checks)
    ks = pid_k * k_len + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    row_in = rows < M
    dt = x_ptr.dtype.element_ty
    if SWAP_AB:
        x_ptrs = x_ptr + rows.to(tl.int64)[None, :] * stride_xm + ks[:, None]  # [BLOCK_K, BLOCK_M]: x^T tile
        w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]: W tile
        x_in = row_in[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N]: W^T tile
        x_in = row_in[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # No kernel writes the weights: under PDL the first weight tile loads while the previous kernel
    # (which writes x) finishes; with EARLY_LAUNCH the next product launches and does the same at once.
    w = tl.load(w_ptrs).to(dt)  # float8 widens exactly
    wait_for_previous_kernel(USE_GDC, EARLY_LAUNCH)
    acc = _mma(w, tl.load(x_ptrs, mask=x_in, other=0.0), acc, SWAP_AB)
    for k0 in range(BLOCK_K, k_len, BLOCK_K):
        a = tl.load(x_ptrs + k0, mask=x_in, other=0.0)
        w = tl.load(w_ptrs + k0).to(dt)
        acc = _mma(w, a, acc, SWAP_AB)
    if SWAP_AB:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    if SPLIT_K == 1:
        _store_tile(acc, b_ptr, s_ptr, y_ptr, rows, cols, row_in, stride_ym, HAS_BIAS)
    else:
        n = tl.num_programs(1) * BLOCK_N
        rows_padded = tl.num_programs(0) * BLOCK_M
        part_tile = part_ptr + rows.to(tl.int64)[:, None] * n + cols[None, :]  # [BLOCK_M, BLOCK_N] of split 0
        tl.store(part_tile + pid_k * rows_padded * n, acc)
        # Every thread's partial is stored before the tile's count is raised (release), and the program
        # that raises it last reads the others' partials only after it (acquire), from L2.
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_tile + s * rows_padded * n, cache_modifier=".cg")
            _store_tile(total, b_ptr, s_ptr, y_ptr, rows, cols, row_in, stride_ym, HAS_BIAS)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")


def default_config(m: int, n: int, k: int) -> GemmConfig | None:
    """A tile for an [m, k] x [n, k]^T product, or None past MAX_ROWS or when no tile divides the weight.

    A product of a few tokens is a weight read. Over an input of >= 4096 and 17-64
    rows it takes swapped tiles (64 weight rows, 128 deep, split 4 ways below 256 column tiles, else 2):
    at 32 rows all of Llama-3-8B's products (its bf16 LM head included) then took 3.92 ms, against 4.55 ms
    with the quantizer plus cuBLAS's float8 product and 4.22 ms with cuBLAS on bf16 weights. Otherwise
    16 x 32 tiles, 512 deep over an input of <= 1024, else 256 deep with the input split 4 ways below 64
    column tiles and 2 ways below 512. Each is the best of H200 sweeps (``linear_shapes.py --fp8 --fp8-sweep``); at 4 rows the
    8B's products (its bf16 LM head included) take 3.2 ms, against 6.3 ms with the general tiles below,
    5.0 ms for the quantizer plus cuBLAS's float8 product, and 4.0 ms for cuBLAS on bf16 weights.

    Weights those tiles do not divide (an input that is no multiple of 256) take general ones, never
    split: rows, the smallest tensor-core tile holding them; columns, narrow enough that the grid has
    about two programs per SM; K steps of 32-128 with a 3-stage pipeline.
    """
    if m > MAX_ROWS:
        return None
    if n % 32 == 0 and k % 256 == 0:
        if m > 16 and k >= 4096 and n % 64 == 0:
            split = 4 if n // 64 < 256 else 2
            cfg = GemmConfig(min(64, triton.next_power_of_2(m)), 64, 128, 4, 3, split, swap_ab=True)
            while cfg.split_k > 1 and (k % (128 * cfg.split_k) or not workspace_fits(cfg, m, n)):
                cfg = cfg._replace(split_k=cfg.split_k // 2)
            return cfg
        if k <= 1024 and k % 512 == 0:
            return GemmConfig(16, 32, 512, 4, 3)
        split = 4 if n // 32 < 64 else 2 if n // 32 < 512 else 1
        while split > 1 and (k % (256 * split) or not workspace_fits(GemmConfig(16, 32, 256, 4, 3, split), m, n)):
            split //= 2
        return GemmConfig(16, 32, 256, 4, 3, split)
    block_k = next((b for b in (128, 64, 32) if k % b == 0), None)
    if block_k is None:
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
        and weight.dtype == torch.float8_e4m3fn
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and default_config(x.shape[0], weight.shape[0], weight.shape[1]) is not None
    )


def workspace_fits(cfg: GemmConfig, m: int, n: int) -> bool:
    """Whether a split launch's partials and tile counters fit the shared workspace."""
    grid_m = triton.cdiv(m, cfg.block_m)
    return cfg.split_k == 1 or (
        cfg.split_k * grid_m * cfg.block_m * n <= WORKSPACE_FLOATS and grid_m * (n // cfg.block_n) <= MAX_TILES
    )


def _workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's partials and zeroed tile counters, made on the first split launch and kept."""
    if device not in _workspaces:
        _workspaces[device] = (
            torch.empty(WORKSPACE_FLOATS, dtype=torch.float32, device=device),
            torch.zeros(MAX_TILES, dtype=torch.int32, device=device),
        )
    return _workspaces[device]


def skinny_gemm(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8 e4m3
    bias: torch.Tensor | None = None,  # [N]
    config: GemmConfig | None = None,
    *,
    scale: torch.Tensor,  # [N] float32 row scales of the weight
    early_launch: bool | None = None,  # None: the rule below
) -> torch.Tensor:  # [M, N]
    m, k = x.shape
    n = weight.shape[0]
    assert weight.dtype == torch.float8_e4m3fn and scale.shape == (n,), "a float8 weight and its row scales"
    cfg = config or default_config(m, n, k)
    assert cfg is not None and n % cfg.block_n == 0 and k % (cfg.block_k * cfg.split_k) == 0, (m, n, k, cfg)
    assert workspace_fits(cfg, m, n), (m, n, cfg)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    parts, counts = _workspace(x.device) if cfg.split_k > 1 else (y, y)
    grid = (triton.cdiv(m, cfg.block_m), n // cfg.block_n, cfg.split_k)
    _skinny_gemm_kernel[grid](
        x, weight, bias if bias is not None else y, scale, y, parts, counts,
        m, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k,
        SWAP_AB=cfg.swap_ab,
        # On an H200 an early launch paid at 16 rows (products 4-11% faster) and cost up to 55% at
        # 128-256, where the next product's loads compete with this one's several waves.
        EARLY_LAUNCH=m <= EARLY_LAUNCH_MAX_ROWS if early_launch is None else early_launch,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch_args(x),
    )
    return y
