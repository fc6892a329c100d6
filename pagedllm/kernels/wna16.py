"""Triton product ``y = x @ W^T`` for 4/8-bit weight-only quantized linears (W4A16, W8A16) kept packed on the GPU.

The weight is in the engine's common packed layout (``layers/quantization/wna16_layout.py``): int32 words
``qweight`` [K / pack, N] holding ``pack = 32 // bits`` unsigned values along the input, value ``i`` of a
word in bits ``[i * bits, (i + 1) * bits)``; ``scales`` [G, N] and ``zeros`` [G, N] (float) per group of
input channels; ``w[n, k] = (q[k, n] - zeros[g, n]) * scales[g, n]`` with ``g = k // group_size`` or, when
a group index is given, ``g = g_idx[k]``.

Each program owns a BLOCK_M x BLOCK_N output tile and walks its share of the input BLOCK_K rows at a time:
it loads the words covering those rows once, shifts and masks each word's values out into consecutive rows
in registers, subtracts the zero point, scales (one row of scales per tile when the tile lies in one group),
casts to the activation dtype and multiplies on the tensor cores with float32 accumulation. The weight never
exists unpacked in memory. For few tokens the input is split over ``SPLIT_K`` programs per tile so that the
grid fills the device; their float32 partial sums are added afterwards. Past 64 rows the tiles compute
W x^T, the unpacked weight being the dot's first operand. One row (batch-1 decode) takes a GEMV without
tensor cores (``kernels/wna16_gemv.py``); from ``DENSE_FROM_ROWS`` rows (half as many for small weights) the
weight is dequantized once and the dense GEMM runs.

Integers become floats by or-ing them into the mantissa of 2**23 and subtracting 2**23 (exact for any value
below 2**23): the GPU converts integers to floats at a quarter of its float rate, and that conversion, once
per weight, bound the kernels before. The W x^T tiles of wide outputs and many rows (``FMA_DEQUANT_MIN_N``,
``FMA_DEQUANT_MIN_ROWS``) go further for 4-bit weights and 16-bit activations (``_scaled_tile``): one rotate,
one AND-OR and one fused multiply-add a value give ``(q - z) * s``, whose one rounding into the activation
dtype may differ from the two-step path's in a rare tie, by one unit. On NVIDIA GPUs from Ampere on, 4-bit tiles of
16-bit activations within one group dequantize two values an instruction instead (``_pairs_tile``, inline PTX): a
LOP3 makes the half-precision pair ``(M + q, M + q')``, a packed fused multiply-add takes ``M + z`` off exactly and
a packed multiply by ``(s, s)`` rounds ``(q - z) s`` once, which is the two-step path's bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels import launch
from pagedllm.kernels.launch import max_shared_memory
from pagedllm.kernels.wna16_gemv import (MAGIC, MAGIC_BITS, PAIR_MAGIC, gemv_block_k, half_bits, neg_offset_pairs,
                                         pairs_apply, pow2_neg, prmt, wna16_gemv)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SUPPORTED_BITS = (2, 4, 8)


# A 4-bit value in the top four bits of a float32 mantissa (``_scaled_value``).
KEEP_BITS = 0xF << 19
# Outputs and rows from which the W x^T tiles dequantize with _scaled_tile: on an H100 it took gate_up at 256 rows
# from 170.4 to 143.7 us, and lost on the narrower products (down 112.0 -> 117.8 us).
FMA_DEQUANT_MIN_N = 16384
FMA_DEQUANT_MIN_ROWS = 256


@triton.jit
def _unpack(words, shifts, MASK: tl.constexpr):
    """The values of int32 words shifted out by ``shifts`` (broadcast), as exact float32: the masked value's bits
    or'ed into 2**23's, minus 2**23, in place of a quarter-rate integer-to-float conversion."""
    return (((words >> shifts) & MASK) | MAGIC_BITS).to(tl.float32, bitcast=True) - MAGIC


@triton.jit
def row_group_scales(s_ptr, z_ptr, gidx_ptr, offs_k, k_ok, offs_n, n_ok, N, GROUP: tl.constexpr,
                     HAS_GIDX: tl.constexpr):
    """The float32 scales and zero points [BK, BN] of each input row ``offs_k``'s own group (``g_idx`` under
    HAS_GIDX, else ``k // GROUP``), for tiles whose groups change inside them; rows [G, N] of ``N`` columns."""
    if HAS_GIDX:
        g = tl.load(gidx_ptr + offs_k, mask=k_ok, other=0)
    else:
        g = offs_k // GROUP
    ok = k_ok[:, None] & n_ok[None, :]
    s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
    return s, z


@triton.jit
def _scaled_value(words, P: tl.constexpr, scale, neg_offset, keep, magic, BITS: tl.constexpr):
    """Value ``P`` of each int32 word dequantized, ``(q - z) * s``, in two integer operations and one fused
    multiply-add: the word is rotated so that the value sits in the top ``BITS`` bits of a float32 mantissa and
    kept with 2**23's exponent bits by one AND-OR, which reads as ``2**23 + q 2**(23 - BITS)``; ``scale`` carries
    ``2**(BITS - 23)`` and ``neg_offset`` is ``-(2**BITS + z) s``. The product inside the fused multiply-add is
    exact, so the one rounding error is ``neg_offset``'s, below ``2**(BITS - 23)`` of ``s``."""
    R: tl.constexpr = (23 - BITS - P * BITS) % 32
    u = words.to(tl.uint32, bitcast=True)
    if R == 0:
        top = u
    else:
        top = (u << R) | (u >> (32 - R))
    v = ((top & keep) | magic).to(tl.float32, bitcast=True)
    return v * scale + neg_offset


@triton.jit
def _scaled_tile(words, scale, neg_offset, keep, magic, BITS: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The dequantized [BLOCK_K, BLOCK_N] float32 tile of 4-bit ``words`` [BLOCK_K / 8, BLOCK_N]: each word's eight
    values are joined in registers of one thread, so every rotation is a constant."""
    return _join8(_scaled_value(words, 0, scale, neg_offset, keep, magic, BITS),
                  _scaled_value(words, 1, scale, neg_offset, keep, magic, BITS),
                  _scaled_value(words, 2, scale, neg_offset, keep, magic, BITS),
                  _scaled_value(words, 3, scale, neg_offset, keep, magic, BITS),
                  _scaled_value(words, 4, scale, neg_offset, keep, magic, BITS),
                  _scaled_value(words, 5, scale, neg_offset, keep, magic, BITS),
                  _scaled_value(words, 6, scale, neg_offset, keep, magic, BITS),
                  _scaled_value(words, 7, scale, neg_offset, keep, magic, BITS), BLOCK_K, BLOCK_N)


@triton.jit
def _join8(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile whose row 8 w + i is ``v_i``'s row w (each [BLOCK_K / 8, BLOCK_N]), joined in
    registers of one thread."""
    t = tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)),
                tl.join(tl.join(v4, v5), tl.join(v6, v7)))  # [W, N, i, j, l]: value 4 l + 2 j + i
    return tl.reshape(tl.permute(t, (0, 4, 3, 2, 1)), (BLOCK_K, BLOCK_N))


def _pairs_dequant_asm(half: str) -> str:
    """PTX dequantizing one word of eight 4-bit values two at a time: ``$8`` the word, ``$9`` the pair ``-(M +
    z)``, ``$10`` the pair ``(s, s)``; ``$0``-``$7`` the values ``(q_i - z) s`` in the half-precision dtype. As in
    the pairs GEMV (``kernels/wna16_gemv.py``), values i and i + 4 come out of one shift and one LOP3 as ``(M + q,
    M + q')``; one fused multiply-add takes ``M + z`` off exactly and one multiply rounds ``(q - z) s`` once, as
    the torch path's float32 product cast to the dtype does: the same bits."""
    magic, one = {"bf16": ("0x43004300", "0x3F803F80"), "f16": ("0x64006400", "0x3C003C00")}[half]
    lines = [".reg .b32 t, v, one, nz;", f"mov.b32 one, {one};", "mov.b32 nz, 0x80008000;"]
    for j in range(4):
        src = "$8"
        if j:
            lines.append(f"shr.u32 t, $8, {4 * j};")
            src = "t"
        lines += [f"lop3.b32 v, {src}, 0x000f000f, {magic}, 0xea;", f"fma.rn.{half}x2 v, v, one, $9;",
                  f"fma.rn.{half}x2 v, v, $10, nz;", f"mov.b32 {{${j}, ${j + 4}}}, v;"]
    return "{\n" + "\n".join(lines) + "\n}"


_PAIRS_DEQUANT_ASM = {torch.bfloat16: _pairs_dequant_asm("bf16"), torch.float16: _pairs_dequant_asm("f16")}


@triton.jit
def _emulated(words, I: tl.constexpr, z, s, BF16: tl.constexpr):
    """Value I of each word as ``_pairs_dequant_asm`` gives it: ``(q - z) * s`` rounded once to the dtype."""
    w = (((words >> (4 * I)) & 0xF).to(tl.float32) - z) * s
    if BF16:
        return w.to(tl.bfloat16)
    else:
        return w.to(tl.float16)


@triton.jit
def _pairs_tile(words, s_bits, nz_bits, ASM: tl.constexpr, MAGIC16: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_N: tl.constexpr, EMULATE: tl.constexpr):
    """The dequantized [BLOCK_K, BLOCK_N] tile of 4-bit ``words`` [BLOCK_K / 8, BLOCK_N] in the 16-bit activation
    dtype, two values an instruction (``_pairs_dequant_asm``); ``s_bits`` and ``nz_bits`` [1, BLOCK_N] int32 hold
    the pairs ``(s, s)`` and ``(-(M + z), -(M + z))``. Under EMULATE (the interpreter) the PTX's arithmetic runs
    as Triton ops on the values those pairs hold."""
    BF16: tl.constexpr = MAGIC16 == 128.0
    if EMULATE:
        s = half_bits(s_bits, BF16)
        z = -half_bits(nz_bits, BF16) - MAGIC16
        v = (_emulated(words, 0, z, s, BF16), _emulated(words, 1, z, s, BF16), _emulated(words, 2, z, s, BF16),
             _emulated(words, 3, z, s, BF16), _emulated(words, 4, z, s, BF16), _emulated(words, 5, z, s, BF16),
             _emulated(words, 6, z, s, BF16), _emulated(words, 7, z, s, BF16))
    elif BF16:
        v = tl.inline_asm_elementwise(ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, nz_bits, s_bits],
                                      dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        v = tl.inline_asm_elementwise(ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, nz_bits, s_bits],
                                      dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    return _join8(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], BLOCK_K, BLOCK_N)


@triton.jit
def _pairs_group_tile(words, s_row, z_row, offs_n, n_ok, ASM: tl.constexpr, MAGIC16: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr):
    """``_pairs_tile`` of a tile within one group, whose scales and zero points start at ``s_row`` and ``z_row``
    (pointers to the group's row; columns ``offs_n``)."""
    s_bits = tl.load(s_row + offs_n[None, :], mask=n_ok[None, :], other=0.0).to(tl.int16, bitcast=True).to(tl.int32)
    z_pairs = neg_offset_pairs(tl.load(z_row + offs_n[None, :], mask=n_ok[None, :], other=0.0), MAGIC16, EMULATE)
    return _pairs_tile(words, prmt(s_bits, s_bits, 0x1010, EMULATE), z_pairs, ASM, MAGIC16, BLOCK_K, BLOCK_N, EMULATE)


@triton.jit
def _wna16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, gidx_ptr, out_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_om, stride_os,
    keep_bits,  # (FMA_DEQUANT) KEEP_BITS, and below MAGIC_BITS: runtime values, so that each AND-OR stays one LOP3
    magic_bits,
    GROUP: tl.constexpr, BITS: tl.constexpr, ROW_GROUPS: tl.constexpr, HAS_GIDX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
    SWAP_AB: tl.constexpr,
    FMA_DEQUANT: tl.constexpr,  # (4-bit, 16-bit activations, groups whole in the tile) _scaled_tile's dequantization
    PAIRS_DEQUANT: tl.constexpr,  # (the same, compiled for NVIDIA, scales in x's dtype) _pairs_tile's
    PAIRS_ASM: tl.constexpr,  # (PAIRS_DEQUANT) _pairs_dequant_asm's PTX for x's dtype
    MAGIC16: tl.constexpr,  # (PAIRS_DEQUANT) M of that dtype
    EMULATE: tl.constexpr,  # (PAIRS_DEQUANT) the interpreter: the PTX's arithmetic as Triton ops
):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    WORDS: tl.constexpr = BLOCK_K // PACK
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    shifts = tl.arange(0, PACK) * BITS
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BM, BK]
        # Each word is read once and its PACK values are shifted out into PACK consecutive rows.
        offs_w = k0 // PACK + tl.arange(0, WORDS)
        words = tl.load(qw_ptr + offs_w[:, None] * N + offs_n[None, :],
                        mask=(offs_w * PACK < k_end)[:, None] & n_ok[None, :], other=0)  # [BK / PACK, BN]
        if ROW_GROUPS:
            q = tl.reshape(_unpack(words[:, None, :], shifts[None, :, None], MASK), (BLOCK_K, BLOCK_N))
            # Groups change inside the tile (act-order indices, or groups smaller than BLOCK_K): per-row gathers.
            s, z = row_group_scales(s_ptr, z_ptr, gidx_ptr, offs_k, k_ok, offs_n, n_ok, N, GROUP, HAS_GIDX)
            w = ((q - z) * s).to(a.dtype)  # [BK, BN], rounded to the activation dtype as the torch path's weight
        else:
            # The whole tile lies in one group: one row of scales and zero points.
            g0 = k0 // GROUP
            s1 = tl.load(s_ptr + g0 * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            z1 = tl.load(z_ptr + g0 * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            if PAIRS_DEQUANT:
                w = _pairs_group_tile(words, s_ptr + g0 * N, z_ptr + g0 * N, offs_n, n_ok, PAIRS_ASM, MAGIC16, BLOCK_K,
                                      BLOCK_N, EMULATE)
            elif FMA_DEQUANT:
                w = _scaled_tile(words, (s1 * pow2_neg(23 - BITS))[None, :], (-(z1 + (1 << BITS)) * s1)[None, :],
                                 keep_bits, magic_bits, BITS, BLOCK_K, BLOCK_N).to(a.dtype)
            else:
                q = tl.reshape(_unpack(words[:, None, :], shifts[None, :, None], MASK), (BLOCK_K, BLOCK_N))
                w = ((q - z1[None, :]) * s1[None, :]).to(a.dtype)
        if SWAP_AB:
            # y^T = W x^T: the unpacked weight is the first operand (the one Hopper's tensor cores may read from
            # registers); on an H100 these tiles beat the x W^T ones at 128-256 rows (benchmarks/quant_kernels.py).
            if DOT_FP32:
                acc = tl.dot(tl.trans(w), tl.trans(a), acc, input_precision="ieee")
            else:
                acc = tl.dot(tl.trans(w), tl.trans(a), acc)
        elif DOT_FP32:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if SWAP_AB:
        out = out_ptr + pid_s * stride_os + offs_n[:, None] + offs_m[None, :] * stride_om
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])
    else:
        out = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _wna16_dequant_kernel(
    qw_ptr, s_ptr, z_ptr, gidx_ptr, w_ptr, N, K,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_GIDX: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Writes the dense weight w [K, N] (kernel row order) in the activation dtype.

    Value ``p`` of each word goes to rows ``p, p + PACK, ...`` of the tile by its own store, so no value moves
    between threads, and a tile inside one group reads its row of scales and zero points once: the kernel then
    streams at the copy rate, where gathering both per value and regrouping the values in shared memory
    kept it at about half of it."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    WORDS: tl.constexpr = BLOCK_K // PACK
    ONE_GROUP: tl.constexpr = (not HAS_GIDX) and GROUP % BLOCK_K == 0
    offs_w = tl.program_id(0) * WORDS + tl.arange(0, WORDS)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_ok = offs_w * PACK < K
    words = tl.load(qw_ptr + offs_w[:, None] * N + offs_n[None, :], mask=w_ok[:, None] & n_ok[None, :], other=0)
    if ONE_GROUP:
        g = tl.program_id(0) * BLOCK_K // GROUP
        s_row = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        z_row = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    for p in tl.static_range(PACK):
        rows = offs_w * PACK + p
        ok = (rows < K)[:, None] & n_ok[None, :]
        q = _unpack(words, p * BITS, MASK)
        if ONE_GROUP:
            s, z = s_row, z_row
        else:
            if HAS_GIDX:
                g = tl.load(gidx_ptr + rows, mask=rows < K, other=0)
            else:
                g = rows // GROUP
            s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(w_ptr + rows[:, None] * N + offs_n[None, :], ((q - z) * s).to(w_ptr.dtype.element_ty), mask=ok)


# The dequantization's tile (inputs, outputs, warps): best or within 0.3% of the best of a 12-tile grid on every
# Llama-3-8B shape (one H100, ~2.7 TB/s; ``quant_kernels.py --dequant``).
DEQUANT_TILE = (128, 256, 4)


def wna16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
                     g_idx: torch.Tensor | None, dtype: torch.dtype,
                     tile: tuple[int, int, int] | None = None) -> torch.Tensor:  # [K, N] in dtype
    """The dense weight in kernel row order, for products with many rows, where the tensor cores' dense
    GEMM on a weight written once beats unpacking it in every output tile."""
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    w = torch.empty((k, n), dtype=dtype, device=qweight.device)
    bk, bn, warps = tile or DEQUANT_TILE
    has_gidx = g_idx is not None
    _wna16_dequant_kernel[(triton.cdiv(k, bk), triton.cdiv(n, bn))](
        qweight, scales, zeros, g_idx if has_gidx else qweight, w, n, k,
        GROUP=group_size, BITS=bits, HAS_GIDX=has_gidx, BLOCK_K=bk, BLOCK_N=bn, num_warps=warps,
    )
    return w


# From this many rows on, a product dequantizes the weight and runs the dense GEMM; from half as many, a product
# of a weight under ``SMALL_WEIGHT`` values does (benchmarks/quant_kernels.py measures the crossing). On an H100
# at Llama-3-8B's shapes the dequantization is a fixed cost that more rows amortize: at 256 rows the tile kernel
# takes 143 / 112 us for gate_up / down against 215 / 113 dense, but 72 / 48 us for qkv / o against 51 / 34;
# at 512 rows the dense path wins on all four.
DENSE_FROM_ROWS = 512
SMALL_WEIGHT = 32 * 1024 * 1024


def _config(m: int, n: int, k: int, device: torch.device,
            x_bytes: int = 2) -> tuple[int, int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, split_k, num_warps, num_stages, swap_ab) for an M x N x K product of
    ``x_bytes``-byte activations."""
    swap = False
    if m <= 16:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 3
    elif m <= 64:
        bm, bn, bk, warps, stages = 32, 64, 64, 4, 3
    elif x_bytes > 2:
        # float32 activations: tiles whose stages fit any GPU's shared memory.
        bm, bn, bk, warps, stages = 64, 128, 32, 4, 3
    else:
        # Many rows (an H100 sweep at 256): large tiles, so that each unpacked weight serves many rows, computed
        # as W x^T; the widest outputs take all 256 rows a tile where a program's shared memory holds four
        # stages of them (~160 KB: Hopper's, not a consumer GPU's 99 KB).
        big = device.type == "cuda" and max_shared_memory(device.index or 0) >= 200 * 1024
        bm = 256 if m > 128 and n >= 16384 and big else 128
        bn, bk, warps, stages, swap = 128, 64, 8, 4 if bm == 256 else 3, True
    split = 1
    if device.type == "cuda":
        # Few output tiles leave most SMs idle; split the input until about two waves of programs run.
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        while tiles * split * 2 <= 2 * sms and k // (split * 2) >= 4 * bk:
            split *= 2
    return bm, bn, bk, split, warps, stages, swap


def wna16_matmul(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32
    qweight: torch.Tensor,  # [K / (32 // bits), N] int32
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N] float
    bits: int,
    group_size: int,  # input channels a group; K for one group
    g_idx: torch.Tensor | None = None,  # [K] int32 group of each input, overriding k // group_size
    split_k: int | None = None,  # None: chosen from the shape
    block: tuple[int, int, int] | None = None,  # (BLOCK_M, BLOCK_N, BLOCK_K); None: chosen from the shape
    warps_stages: tuple[int, int] | None = None,  # (num_warps, num_stages); None: chosen from the shape
    dense_from_rows: int | None = None,  # None: DENSE_FROM_ROWS
    gemv: bool | None = None,  # one row through wna16_gemv; None: wherever its group condition holds
    swap_ab: bool | None = None,  # the tile product as W x^T (the weight as the first operand); None: by shape
    fma_dequant: bool | None = None,  # 4-bit tiles of 16-bit activations through _scaled_tile; None: by shape
    pairs_dequant: bool | None = None,  # 4-bit tiles through _pairs_tile; None: wherever it runs
) -> torch.Tensor:  # [M, N] in x's dtype
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"wna16: activation dtype {x.dtype} is not one of {SUPPORTED_DTYPES}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"wna16: bits {bits} is not one of {SUPPORTED_BITS}")
    m, k = x.shape
    pack = 32 // bits
    n = qweight.shape[1]
    if qweight.shape[0] * pack != k:
        raise ValueError(f"wna16: qweight has {qweight.shape[0]} words a column ({qweight.shape[0] * pack} inputs) "
                         f"for {k} activation columns")
    if scales.shape != zeros.shape or scales.shape[1] != n:
        raise ValueError(f"wna16: scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} must both be [G, {n}]")
    if group_size <= 0:
        raise ValueError(f"wna16: group_size {group_size} must be a positive number of inputs")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if not t.is_contiguous():
            raise ValueError(f"wna16: {name} must be contiguous (rows of {n} columns), got strides {t.stride()}")
    x = x.contiguous()
    if dense_from_rows is None:
        dense_from_rows = DENSE_FROM_ROWS // 2 if n * k <= SMALL_WEIGHT else DENSE_FROM_ROWS
    if m >= dense_from_rows:
        return x @ wna16_dequantize(qweight, scales, zeros, bits, group_size, g_idx, x.dtype)
    if gemv is None:
        gemv = m == 1 and g_idx is None and block is None and gemv_block_k(group_size, k, bits) is not None
    if gemv:
        return wna16_gemv(x, qweight, scales, zeros, bits, group_size)
    bm, bn, bk, split, warps, stages, swap = _config(m, n, k, x.device, x.element_size())
    if swap_ab is not None:
        swap = swap_ab
    if block is not None:
        bm, bn, bk = block
    elif g_idx is None and 16 <= group_size < bk and group_size % pack == 0:
        bk = group_size  # a tile within one group reads one row of scales
    if warps_stages is not None:
        warps, stages = warps_stages
    if split_k is not None:
        split = split_k
    # Every split owns a whole number of BLOCK_K runs.
    k_per_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_per_split)
    out_dtype = x.dtype if split == 1 else torch.float32
    out = torch.empty((split, m, n), dtype=out_dtype, device=x.device)
    has_gidx = g_idx is not None
    gidx = g_idx if has_gidx else qweight  # any pointer; not read without HAS_GIDX
    row_groups = has_gidx or group_size % bk != 0
    if fma_dequant is None:
        fma_dequant = swap and n >= FMA_DEQUANT_MIN_N and m >= FMA_DEQUANT_MIN_ROWS
    fma_dequant = fma_dequant and bits == 4 and x.dtype != torch.float32 and not row_groups
    pairs_ok = not row_groups and scales.dtype == x.dtype
    if pairs_dequant is None:
        pairs_dequant = pairs_ok and pairs_apply(x, bits)
    elif pairs_dequant and not (pairs_ok and bits == 4 and x.dtype in PAIR_MAGIC
                                and (pairs_apply(x, bits) or launch.triton_interpreted())):
        raise ValueError("wna16: pairs dequantization takes 4-bit weights, 16-bit activations on an NVIDIA GPU "
                         "(or in Triton's interpreter), "
                         f"scales in their dtype and tiles within one group (got {bits} bits, {x.dtype} on "
                         f"{x.device}, scales {scales.dtype}, group {group_size}, BLOCK_K {bk})")
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    _wna16_kernel[grid](
        x, qweight, scales, zeros, gidx, out, m, n, k, k_per_split,
        x.stride(0), out.stride(1), out.stride(0), KEEP_BITS, MAGIC_BITS.value,
        GROUP=group_size, BITS=bits, HAS_GIDX=has_gidx, ROW_GROUPS=row_groups,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_FP32=x.dtype == torch.float32, SWAP_AB=swap,
        FMA_DEQUANT=fma_dequant, PAIRS_DEQUANT=pairs_dequant, PAIRS_ASM=_PAIRS_DEQUANT_ASM.get(x.dtype, ""),
        MAGIC16=PAIR_MAGIC.get(x.dtype, 0.0), EMULATE=launch.triton_interpreted(), num_warps=warps, num_stages=stages,
    )
    if split == 1:
        return out[0]
    return out.sum(0).to(x.dtype)
