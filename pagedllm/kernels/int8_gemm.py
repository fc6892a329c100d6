"""Triton W8A8 int8 linears, bit for bit ``w8a8_linear``'s torch path: one launch for decode rows
(``w8a8_decode``, at most 16), row and column tiles for more (``w8a8_tiles``).

A launch applies both scales (and the bias) to the exact int32 product of the int8 rows and the int8
weight. The torch path runs four launches a linear on CUDA (the row quantizer, a pad to 32 rows, cuBLAS's
int8 product, ``int8_quant.py``'s epilogue), and cuBLAS answers a few rows against a wide weight slowly: on
an H100, 51 us for Llama-3-8B's gate_up at one row, where the decode launch takes 44 (bf16: 79); at 256 rows
cuBLAS's int8 product of that shape took 91 us against bf16's 101.

Each program owns ``BLOCK_N`` output columns, i.e. ``BLOCK_N`` contiguous weight rows of K bytes
(coalesced), and ``BLOCK_M`` rows, and walks all of K in ``BLOCK_K`` steps: no split-K, so no partial sums
in memory, no second launch, and a fixed summation order; it adds each step's int8 x int8 tensor-core
product to an int32 accumulator, exact as cuBLAS's. The row tiles of one column tile are neighbouring
programs, so a weight tile is read from memory once. One row is quantized inside the launch: every program
takes the row's largest magnitude (x stays in L2) and quantizes its x tile with ``int8_quant``'s own
arithmetic (shared jit helpers, so the bits cannot drift apart), an IEEE division per value that every
program repeats. From two rows on that repetition costs more than a launch, so the rows are quantized once
first (``prequantize``, ``int8_quant.quantize_rows``) and the kernel reads them; rows the norm or activation
kernel before the linear already quantized (``row_quant.QuantizedRows``) are read so at any count, and rows with
a zero point each (asymmetric activations) are always quantized first. At decode ``BLOCK_M`` is the rows
rounded up to a power of two (Triton pads the tensor-core tile); ``default_config`` holds the tiles an H100
sweep chose, ``tile_config`` those of more rows.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.kernels import int8_quant, launch
from pagedllm.kernels.int8_quant import SUPPORTED_DTYPES, quantize_int8, row_scale, scaled_sums
from pagedllm.kernels.launch import max_shared_memory, pdl_launch_args, wait_for_previous_kernel
from pagedllm.kernels.numerics import add_rn, exact_rounding
from pagedllm.kernels.row_quant import QuantizedRows

# Rows the decode launch takes: one tensor-core tile's rows (the int8 mma is 16 rows deep).
MAX_ROWS = 16
# Rows from which the tiles beat the quantizer + cuBLAS path (an H100 at Llama-3-8B's shapes, 64 to 4096 rows:
# at 64 cuBLAS's split products win on the long ``down`` input; from 256 on the tiles win, most at 4096).
TILES_MIN_ROWS = 65
# The longest input whose int32 sums cannot overflow (|q_x * q_w| <= 128 * 128): compiled int8 mma
# saturates (``.satfinite``) where cuBLAS would wrap, so past it the two could differ.
MAX_K = (2**31 - 1) // (128 * 128)


class TileConfig(NamedTuple):
    block_m: int  # activation rows a program holds (a power of two >= M, at most 16; rows >= M masked)
    block_n: int  # output columns (weight rows) a program owns
    block_k: int  # input columns a step reads; >= 32, the int8 dot's shortest K on NVIDIA
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs along K per tile (row tiles only), summed in the launch by the last to finish


@triton.jit
def _x_tile(x_ptrs, k0, rows_in, ks, K):
    """The [BLOCK_M, BLOCK_K] activation tile at ``k0`` as float32, zeros past M rows and K columns."""
    return tl.load(x_ptrs + k0, mask=rows_in[:, None] & (k0 + ks < K)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _xq_tile(x_ptrs, k0, rows_in, ks, K):
    """The [BLOCK_M, BLOCK_K] tile of already quantized int8 rows at ``k0``, zeros past M rows and K columns."""
    return tl.load(x_ptrs + k0, mask=rows_in[:, None] & (k0 + ks < K)[None, :], other=0)


@triton.jit
def _w_tile(w_ptrs, k0, cols_in, ks, K):
    """The [BLOCK_N, BLOCK_K] int8 weight tile at ``k0``, zeros past N rows and K columns (they add nothing)."""
    return tl.load(w_ptrs + k0, mask=cols_in[:, None] & (k0 + ks < K)[None, :], other=0)


@triton.jit
def _store_scaled(acc, xs, ws, xz, row_sums, b_ptr, out_ptr, rows, cols, cols_in, tile_in, N, HAS_BIAS: tl.constexpr,
                  EXACT: tl.constexpr, ZERO_POINTS: tl.constexpr):
    """int8_quant's epilogue of an int32 tile [BLOCK_M, BLOCK_N]: (acc (- x zero * w row sum) * x scale) * w scale
    (+ bias), each rounded as torch's float32 ops, stored in the output's dtype."""
    y = scaled_sums(acc, xs[:, None], ws[None, :], xz[:, None], row_sums[None, :], EXACT, ZERO_POINTS)
    if HAS_BIAS:
        y = add_rn(y, tl.load(b_ptr + cols, mask=cols_in, other=0.0).to(tl.float32)[None, :], EXACT)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=tile_in)


@triton.jit
def _w8a8_kernel(
    x_ptr,  # [M, K] float16/bfloat16/float32 (int8 under PREQUANT), last dim contiguous
    xs_ptr,  # [M] float32 row scales (read only under PREQUANT)
    xz_ptr,  # [M] float32 row zero points (ZERO_POINTS only)
    rs_ptr,  # [N] float32 sums of the weight rows (ZERO_POINTS only)
    w_ptr,  # [N, K] int8, last dim contiguous
    ws_ptr,  # [N] float32 weight row scales, contiguous
    b_ptr,  # [N] bias, contiguous (read only when HAS_BIAS)
    out_ptr,  # [M, N] x's dtype, contiguous
    part_ptr,  # [splits, M, N] int32 partial products (SPLIT only)
    count_ptr,  # [>= tiles] int32, zero between launches: splits of each tile that have finished (SPLIT only)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    row_tiles,  # programs along M: program p takes row tile p % row_tiles of column tile p // row_tiles
    k_per_split,  # inputs of one split (axis 1 of the grid), a multiple of BLOCK_K; K when there is one
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EXACT: tl.constexpr,  # compiled NVIDIA code: explicit round-to-nearest products and sums (numerics.py)
    RECIPROCAL: tl.constexpr,  # the scale as torch on CUDA computes it (int8_quant.row_scale)
    EARLY_LAUNCH: tl.constexpr,  # (USE_GDC) let the next kernel launch as soon as this one has waited
    USE_GDC: tl.constexpr,  # launched with PDL: wait for the previous kernel first (kernels/launch.py)
    PREQUANT: tl.constexpr,  # x is already int8_quant.quantize_rows's output, its scales at xs_ptr
    SPLIT: tl.constexpr,  # (PREQUANT) K in several programs a tile; the last of them to finish sums and stores
    ZERO_POINTS: tl.constexpr = False,  # (PREQUANT) asymmetric rows: x's zero point times each weight row's sum off
):
    # The row tiles of one column tile run side by side, so its weight is read from memory once.
    pid = tl.program_id(0)
    rows = (pid % row_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    rows_in = rows < M
    cols = (pid // row_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    cols_in = cols < N
    ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]
    # No kernel writes the weights or their scales: under PDL they are read while the previous kernel
    # (which writes x) finishes, and only x waits for it.
    w = _w_tile(w_ptrs, k_lo, cols_in, ks, K)
    ws = tl.load(ws_ptr + cols, mask=cols_in, other=0.0)  # [BLOCK_N]
    wait_for_previous_kernel(USE_GDC, EARLY_LAUNCH)

    if ZERO_POINTS:
        xz = tl.load(xz_ptr + rows, mask=rows_in, other=0.0)  # [BLOCK_M]
        row_sums = tl.load(rs_ptr + cols, mask=cols_in, other=0.0)  # [BLOCK_N]
    else:
        xz = tl.zeros([BLOCK_M], dtype=tl.float32)
        row_sums = tl.zeros([BLOCK_N], dtype=tl.float32)
    if PREQUANT:
        xs = tl.load(xs_ptr + rows, mask=rows_in, other=1.0)  # [BLOCK_M]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        acc = tl.dot(_xq_tile(x_ptrs, k_lo, rows_in, ks, K), tl.trans(w), acc, out_dtype=tl.int32)
        for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
            acc = tl.dot(_xq_tile(x_ptrs, k0, rows_in, ks, K), tl.trans(_w_tile(w_ptrs, k0, cols_in, ks, K)), acc,
                         out_dtype=tl.int32)
    else:
        # Each row's scale as int8_quant's row quantizer computes it: max is exact and order-free, so
        # reducing [BLOCK_M, BLOCK_K] tiles of running maxima gives its bits. Two tiles a step: their loads are in
        # flight together, and the product cannot start before the last step.
        amax = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        amax2 = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, 2 * BLOCK_K):
            amax = tl.maximum(amax, tl.abs(_x_tile(x_ptrs, k0, rows_in, ks, K)))
            amax2 = tl.maximum(amax2, tl.abs(_x_tile(x_ptrs, k0 + BLOCK_K, rows_in, ks, K)))
        xs = row_scale(tl.max(tl.maximum(amax, amax2), axis=1), EXACT, RECIPROCAL)  # [BLOCK_M]; EPS for zero rows

        # The exact int32 product: int8 x int8 tensor-core steps, K-major on both sides (W's rows are K-contiguous,
        # the layout 8-bit mma operands need). Masked entries quantize to 0 (0 / scale) and add nothing.
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        xq = quantize_int8(_x_tile(x_ptrs, 0, rows_in, ks, K), xs[:, None], EXACT)  # [BLOCK_M, BLOCK_K] int8
        acc = tl.dot(xq, tl.trans(w), acc, out_dtype=tl.int32)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            xq = quantize_int8(_x_tile(x_ptrs, k0, rows_in, ks, K), xs[:, None], EXACT)
            acc = tl.dot(xq, tl.trans(_w_tile(w_ptrs, k0, cols_in, ks, K)), acc, out_dtype=tl.int32)

    tile_in = rows_in[:, None] & cols_in[None, :]
    if SPLIT:
        # Integer sums: the splits add up to the one-program product exactly, in any order. Each split leaves
        # its int32 tile; the last to finish adds them and stores the output, so the product stays one launch.
        tile_off = rows.to(tl.int64)[:, None] * N + cols[None, :]  # [BLOCK_M, BLOCK_N]
        tl.store(part_ptr + tl.program_id(1) * M * N + tile_off, acc, mask=tile_in)
        tl.debug_barrier()  # every thread's partial tile stored before the count moves
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:
            tl.debug_barrier()
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
            for sp in range(0, tl.num_programs(1)):
                acc += tl.load(part_ptr + sp * M * N + tile_off, mask=tile_in, other=0, cache_modifier=".cg")
            _store_scaled(acc, xs, ws, xz, row_sums, b_ptr, out_ptr, rows, cols, cols_in, tile_in, N, HAS_BIAS, EXACT,
                          ZERO_POINTS)
            tl.atomic_xchg(count_ptr + pid, 0, sem="relaxed", scope="gpu")
    else:
        _store_scaled(acc, xs, ws, xz, row_sums, b_ptr, out_ptr, rows, cols, cols_in, tile_in, N, HAS_BIAS, EXACT,
                      ZERO_POINTS)


def default_config(m: int, n: int, k: int) -> TileConfig:
    """The tile for an [m, k] x [n, k]^T product of at most 16 rows, from a sweep on an H100 over Llama-3-8B's
    shapes (``benchmarks/quant_kernels.py --int8 --sweep``):

    - rows: M rounded up to a power of two (1, 2, 4, 8, 16), never more rows than there are;
    - 64 columns a program for wide outputs (qkv, gate_up) and 32 for 4096 (o, down: 128 programs), with
      K steps of 256 for the wide ones and 512 for the narrow ones, whose programs stream longer rows;
    - never a step under the int8 dot's 32; 4 warps and a 3-stage pipeline.
    """
    wide = n >= 6144
    block_k = min(256 if wide else 512, max(32, triton.next_power_of_2(k)))
    return TileConfig(max(1, triton.next_power_of_2(m)), 64 if wide else 32, block_k, 4, 3)


def _operand(x: torch.Tensor | QuantizedRows) -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype]:
    """(the rows the kernel reads, their scales where a producer already quantized them, the output dtype)."""
    if isinstance(x, QuantizedRows):
        return x.q, x.scales, x.dtype
    return x, None, x.dtype


def _rows_ok(xin: torch.Tensor, xs: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """[M, K] rows with a contiguous last dim: float rows, or int8 rows with [M, 1] float32 scales."""
    if xs is not None and (xin.dtype != torch.int8 or xs.dtype != torch.float32 or xs.shape != (xin.shape[0], 1)):
        return False
    return xin.dim() == 2 and dtype in SUPPORTED_DTYPES and (xs is not None or xin.dtype == dtype) and (
        xin.numel() == 0 or xin.stride(-1) == 1)


def _runnable(x: torch.Tensor | QuantizedRows, weight: torch.Tensor) -> bool:
    xin, xs, dtype = _operand(x)
    return (
        _rows_ok(xin, xs, dtype)
        and xin.is_cuda
        and xin.stride(-1) == 1
        and weight.dim() == 2
        and weight.device == xin.device
        and weight.dtype == torch.int8
        and weight.shape[1] == xin.shape[1]
        and weight.shape[1] <= MAX_K
        and weight.stride(-1) == 1
    )


def usable(x: torch.Tensor | QuantizedRows, weight: torch.Tensor) -> bool:
    """1-16 rows on CUDA in a 16/32-bit float type (or already quantized to int8) against a contiguous-rowed int8
    weight of the same input size (at most ``MAX_K``): ``w8a8_decode``."""
    return 0 < x.shape[0] <= MAX_ROWS and _runnable(x, weight)


def tiles_usable(x: torch.Tensor | QuantizedRows, weight: torch.Tensor) -> bool:
    """From ``TILES_MIN_ROWS`` rows on, otherwise as ``usable``: ``w8a8_tiles``."""
    return x.shape[0] >= TILES_MIN_ROWS and _runnable(x, weight)


def _check_config(cfg: TileConfig, m: int) -> None:
    def pow2(v: int) -> bool:
        return v > 0 and v & (v - 1) == 0

    if not (pow2(cfg.block_m) and m <= cfg.block_m <= MAX_ROWS):
        raise ValueError(f"block_m={cfg.block_m}: must be a power of two from the {m} rows up to {MAX_ROWS}")
    if not (pow2(cfg.block_n) and pow2(cfg.block_k) and cfg.block_k >= 32):
        raise ValueError(f"block_n={cfg.block_n}, block_k={cfg.block_k}: powers of two, block_k >= 32")


def _check_operands(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, row_sums: torch.Tensor | None = None) -> None:
    xin, xs, dtype = _operand(x)
    if row_sums is not None and (row_sums.dtype != torch.float32 or tuple(row_sums.shape) != (weight.shape[0],)
                                 or not row_sums.is_contiguous()):
        raise ValueError(f"weight_row_sums: [{weight.shape[0]}] float32, contiguous; got {row_sums.dtype} "
                         f"{tuple(row_sums.shape)}")
    zeros = x.zeros if isinstance(x, QuantizedRows) else None
    if xs is not None and (zeros is None) != (row_sums is None):
        raise ValueError("weight_row_sums: given exactly when the QuantizedRows carry zero points; got "
                         f"{'no ' if row_sums is None else ''}row sums for rows {'with' if zeros is not None else 'without'}"
                         " zero points")
    if not _rows_ok(xin, xs, dtype):
        raise ValueError(f"x: a [M, K] float16/bfloat16/float32 tensor with contiguous rows (or QuantizedRows of "
                         f"int8 and [M, 1] float32 scales), got {xin.dtype} {tuple(xin.shape)} strides {xin.stride()}"
                         + ("" if xs is None else f", scales {xs.dtype} {tuple(xs.shape)}"))
    k = xin.shape[1]
    if k > MAX_K:
        raise ValueError(f"x: K={k} past MAX_K={MAX_K}, where int32 sums could overflow")
    if weight.dim() != 2 or weight.dtype != torch.int8 or weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(f"weight: an [N, {k}] int8 tensor with contiguous rows, got {weight.dtype} "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    n = weight.shape[0]
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) not in ((n,), (n, 1)):
        raise ValueError(f"weight_scale: [{n}, 1] or [{n}] float32, got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    if bias is not None and (bias.shape != (n,) or not bias.is_floating_point()):
        raise ValueError(f"bias: [{n}] floating point, got {bias.dtype} {tuple(bias.shape)}")


def _kernel_rows(x: torch.Tensor | QuantizedRows, weight_row_sums: torch.Tensor | None, quantize: bool):
    """(the rows the kernel reads, their scales or None, (zero points, weight row sums) or None): a producer's rows
    as they are; float rows quantized here with a zero point each when ``weight_row_sums`` is given, else
    symmetrically when ``quantize``."""
    xin, xs, _ = _operand(x)
    xz = x.zeros if isinstance(x, QuantizedRows) else None
    if xs is None and weight_row_sums is not None:
        xin, xs, xz = int8_quant.quantize_rows_with_zeros(xin)
    elif xs is None and quantize:
        xin, xs = int8_quant.quantize_rows(xin)
    return xin, xs, None if xz is None else (xz, weight_row_sums)


def _launch(xin: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
            bias: torch.Tensor | None, out: torch.Tensor, cfg: TileConfig, prequantized: bool,
            early_launch: bool, zeros: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """``xin``: float rows, or (``prequantized``) int8 rows with their scales ``xs``; ``zeros``: the int8 rows'
    zero points [M, 1] and the weight rows' sums [N] (asymmetric rows)."""
    m, k = xin.shape
    n = weight.shape[0]
    row_tiles = triton.cdiv(m, cfg.block_m)
    tiles = row_tiles * triton.cdiv(n, cfg.block_n)
    # Whole K steps a split, and no split left empty.
    steps = triton.cdiv(k, cfg.block_k)
    per_split = triton.cdiv(steps, max(1, min(cfg.split_k, steps)))
    splits = triton.cdiv(steps, per_split)
    counts = launch.split_counts(xin.device, tiles) if splits > 1 and prequantized else None
    if counts is None:  # no count buffer (a first call inside a CUDA-graph capture): one program a tile
        splits, per_split = 1, steps
    part = torch.empty((splits, m, n), dtype=torch.int32, device=xin.device) if splits > 1 else out
    _w8a8_kernel[(tiles, splits)](
        xin, xs, *(zeros if zeros is not None else (out, out)),
        weight, weight_scale.reshape(-1).contiguous(), bias.contiguous() if bias is not None else out, out,
        part, counts if counts is not None else out,
        m, n, k, xin.stride(0), weight.stride(0), row_tiles, per_split * cfg.block_k,
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EXACT=exact_rounding(xin),
        RECIPROCAL=exact_rounding(xin),  # as int8_quant.quantize_rows: torch's CUDA scalar division
        EARLY_LAUNCH=early_launch,
        PREQUANT=prequantized,
        SPLIT=splits > 1,
        ZERO_POINTS=zeros is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch_args(xin),
    )


def w8a8_decode(
    x: torch.Tensor | QuantizedRows,  # [M, K] float16/bfloat16/float32 (or int8 rows and scales), M <= 16
    weight: torch.Tensor,  # [N, K] int8, last dim contiguous
    weight_scale: torch.Tensor,  # [N, 1] or [N] float32
    bias: torch.Tensor | None = None,  # [N]
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_k: int | None = None,  # programs along K per tile, over int8 rows only
    early_launch: bool = False,
    prequantize: bool | None = None,  # rows quantized in their own launch first; None: for more than one row
    weight_row_sums: torch.Tensor | None = None,  # [N] float32: x's rows take a zero point each (asymmetric)
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ W^T`` of W8A8 int8: x's rows quantized symmetrically per row, the exact int32 product, scaled by
    both scales (+ bias) in float32, rounded to x's dtype; one launch (or two, ``prequantize``). Rows a producer
    already quantized (``QuantizedRows``) are read as they are. With ``weight_row_sums`` float rows are quantized
    with a zero point each in a launch first (or a producer's rows carry theirs), and each zero point times the
    weight row's sum comes off the int32 product. Tile arguments left None take ``default_config``'s."""
    _check_operands(x, weight, weight_scale, bias, weight_row_sums)
    xin, xs, dtype = _operand(x)
    m, k = xin.shape
    if m > MAX_ROWS:
        raise ValueError(f"x has {m} rows: w8a8_decode takes at most {MAX_ROWS} (more take w8a8_tiles)")
    n = weight.shape[0]
    given = (block_m, block_n, block_k, num_warps, num_stages, split_k)
    cfg = TileConfig(*(v if v is not None else d for v, d in zip(given, default_config(m, n, k))))
    _check_config(cfg, m)
    out = torch.empty((m, n), dtype=dtype, device=xin.device)
    if m == 0 or n == 0:
        return out
    if prequantize is None:
        # Every program quantizing all rows again costs more than a second launch from two rows on (H100); two
        # launches, but no program repeats the rows' quantization (a division per value).
        prequantize = m > 1
    xin, xs, zeros = _kernel_rows(x, weight_row_sums, prequantize)
    _launch(xin, out if xs is None else xs, weight, weight_scale, bias, out, cfg, xs is not None, early_launch, zeros)
    return out


def tile_config(m: int, n: int, k: int, shared_memory: int = 227 * 1024) -> TileConfig:
    """The tile of a product of more than ``MAX_ROWS`` rows, from H100 sweeps of Llama-3-8B's shapes at 256-4096
    rows (``benchmarks/quant_kernels.py --int8 --sweep``): 128 rows x 128 columns a program in 128-deep int8 steps
    on 4 warps (at 4,096 rows 197 us against 254 on 8 warps); 64 columns where 128 would leave fewer programs
    than an H100 has SMs (qkv at 256 rows 22.5 us against 24.8), and then long inputs split in two along K
    (``down`` at 256 rows 55.3 against 58.1 us). Triton keeps an int32 accumulator's tensor-core product
    synchronous, so more programs an SM, not larger tiles, keep the tensor cores fed: 256-row tiles on 8 warps
    lost on every shape."""
    bm = 128 if m > 64 else 64
    # Either tile's stages take ~96 KB of shared memory; where a program has less than 128 KB (consumer GPUs:
    # 99 KB, part of it reserved), two stages.
    few = shared_memory < 128 * 1024
    if triton.cdiv(m, bm) * triton.cdiv(n, 128) < 128:
        return TileConfig(bm, 64, 128, 4, 2 if few else 4, 2 if k >= 8192 else 1)
    return TileConfig(bm, 128, 128, 4, 2 if few else 3)


def w8a8_tiles(
    x: torch.Tensor | QuantizedRows,  # [M, K] float16/bfloat16/float32 (or int8 rows and scales)
    weight: torch.Tensor,  # [N, K] int8, last dim contiguous
    weight_scale: torch.Tensor,  # [N, 1] or [N] float32
    bias: torch.Tensor | None = None,  # [N]
    *,
    config: TileConfig | None = None,  # None: tile_config's
    weight_row_sums: torch.Tensor | None = None,  # [N] float32: x's rows take a zero point each (asymmetric)
) -> torch.Tensor:  # [M, N] in x's dtype
    """``w8a8_decode``'s product for any number of rows: rows quantized in their own launch (unless a producer
    already did), then row and column tiles of the same kernel (epilogue and bits as ``int8_quant.scale_rows``
    over cuBLAS's product)."""
    _check_operands(x, weight, weight_scale, bias, weight_row_sums)
    xin, xs, dtype = _operand(x)
    m, k = xin.shape
    n = weight.shape[0]
    cfg = config or tile_config(m, n, k, max_shared_memory(xin.device.index or 0) if xin.is_cuda else 227 * 1024)
    if not all(v > 0 and v & (v - 1) == 0 for v in cfg[:3]) or cfg.block_k < 32 or cfg.split_k < 1:
        raise ValueError(f"{cfg}: block sizes must be powers of two, block_k >= 32, split_k >= 1")
    out = torch.empty((m, n), dtype=dtype, device=xin.device)
    if m == 0 or n == 0:
        return out
    xin, xs, zeros = _kernel_rows(x, weight_row_sums, True)
    _launch(xin, xs, weight, weight_scale, bias, out, cfg, True, False, zeros)
    return out
