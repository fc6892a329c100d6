"""Triton one-row products ``y = x @ W^T`` for packed 4/8-bit weights (W4A16 / W8A16 batch-1 decode), in one launch.

The weight is in the engine's common packed layout (``kernels/wna16.py``): int32 words ``qweight`` [K / pack, N],
value ``i`` of a word in bits ``[i * bits, (i + 1) * bits)`` along the input, ``scales`` and integer ``zeros``
[G, N]. One row leaves no tensor-core tile to fill, so these kernels multiply on the CUDA cores, and at one row
a product is a read of the weight: what limits them is the instructions each weight costs.

Two kernels, both splitting the input over programs until the grid fills the device; the last split of each
column tile to finish adds the others' float32 sums and writes the output, in split order:
- ``_wna16_gemv_kernel``, any bits and activation dtype, in float32: three instructions a weight (an AND, a
  subtract, a multiply-add), which is the reference for the other and runs under the interpreter;
- ``_wna16_gemv_pairs_kernel``, 4-bit weights and 16-bit activations on NVIDIA GPUs: two weights a 32-bit
  instruction. One LOP3 turns two values of a word into the half-precision pair ``(M + q, M + q')`` (``M`` is
  128 in bfloat16, 1024 in float16, whose last mantissa bit is worth 1), one fused multiply-add subtracts
  ``M + z`` exactly (``z`` is an integer), and one more multiplies the pair by two activations and adds it to a
  running pair; each half of that pair sums eight products (two words) before it is widened to float32. The
  products and running sums are rounded to the activation dtype, so the result is within a few units in the
  last place of the float32 kernel's, not equal to it (``docs/performance.md`` gives the error measured).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedllm.kernels import launch

MAGIC_BITS = tl.constexpr(0x4B000000)  # float32 2**23: its 23 mantissa bits hold an unsigned integer exactly
MAGIC = tl.constexpr(8388608.0)


@triton.jit
def _float_bits(words, MASK: tl.constexpr, SH: tl.constexpr):
    """``q * 2**SH`` as float32 for the value in bits [SH, SH + bits) of each int32 word (SH + bits <= 23) whose
    exponent bits are already 2**23's (or'ed in by the caller, once for all values of the word)."""
    return (words & (MAGIC_BITS | (MASK << SH))).to(tl.float32, bitcast=True) - MAGIC


@triton.jit
def pow2_neg(SH: tl.constexpr):
    return 1.0 / (1 << SH)


@triton.jit
def _write_row(out, out_ptr, part_ptr, lock_ptr, offs_n, n_ok, N, pid_n, pid_s, num_splits,
               REDUCE_LAST: tl.constexpr):
    """Writes a program's float32 sums ``out`` [BN]. With REDUCE_LAST each split leaves its sums in ``part_ptr``
    [splits, N], and the last split of the column tile to finish adds them in split order and writes the output:
    the product takes one launch (no sum and cast launches after it) and its result never depends on which split
    ends first; that split then clears the count for the next launch. Otherwise one split writes the output, or
    several (no count buffer) their rows of float32 partial sums."""
    if REDUCE_LAST:
        tl.store(part_ptr + pid_s * N + offs_n, out, mask=n_ok)
        tl.debug_barrier()  # every thread's partial sums stored before the count moves
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            total = tl.zeros(out.shape, dtype=tl.float32)
            for sp in range(0, num_splits):
                total += tl.load(part_ptr + sp * N + offs_n, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(out_ptr + pid_s * N + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _wna16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr,
    part_ptr,  # [splits, N] float32 partial sums (REDUCE_LAST)
    lock_ptr,  # [>= column tiles] int32, zero between launches: splits of each column tile that have finished
    N, K, CHUNKS_PER_SPLIT, num_splits,
    GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    REDUCE_LAST: tl.constexpr,
):
    """Within a group (BLOCK_K divides GROUP) the zero point and scale are applied once per word instead of per
    weight: ``sum_p x_p (q_p - z) s = s sum_p x_p q_p - z s sum_p x_p``. A value is taken out of its word in
    place, scaled by its position: ``(word & (MASK << SH)) | 2**23's bits`` read as a float is ``2**23 + q 2**SH``
    exactly, and the matching activation carries ``2**-SH``; the exponent's bits are or'ed into the word once, so
    each weight costs one AND, one subtract and one multiply-add (values above bit 22 share one shift of the word
    by 16), with no integer-to-float conversion, which runs at a quarter of the rate."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    WORDS: tl.constexpr = BLOCK_K // PACK
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_w = tl.arange(0, WORDS)
    c_start = pid_s * CHUNKS_PER_SPLIT
    c_end = tl.minimum(c_start + CHUNKS_PER_SPLIT, K // BLOCK_K)
    acc = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    for c in range(c_start, c_end):
        k0 = c * BLOCK_K
        words = tl.load(qw_ptr + (k0 // PACK + offs_w)[:, None] * N + offs_n[None, :], mask=n_ok[None, :],
                        other=0)  # [WORDS, BN]
        # 2**23's exponent bits or'ed in once a word (the values they cover are read from the shifted copy):
        # then one AND a value keeps its bits and the exponent's.
        low = words | MAGIC_BITS
        high = (words >> 16) | MAGIC_BITS
        part = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        xsum = tl.zeros((WORDS,), dtype=tl.float32)
        for p in tl.static_range(PACK):
            xp = tl.load(x_ptr + k0 + offs_w * PACK + p).to(tl.float32)  # [WORDS]: input p of each word
            xsum += xp
            if p * BITS + BITS <= 23:
                qf = _float_bits(low, MASK, p * BITS)
                part += qf * (xp * pow2_neg(p * BITS))[:, None]
            else:
                qf = _float_bits(high, MASK, p * BITS - 16)
                part += qf * (xp * pow2_neg(p * BITS - 16))[:, None]
        g = k0 // GROUP
        s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        acc += part * s[None, :] - (z * s)[None, :] * xsum[:, None]
    _write_row(tl.sum(acc, axis=0), out_ptr, part_ptr, lock_ptr, offs_n, n_ok, N, pid_n, pid_s, num_splits,
               REDUCE_LAST)


def _pair_asm(half: str) -> str:
    """PTX for two words of eight 4-bit values each (inputs of the same outputs, consecutive along the input):
    ``$1``, ``$2`` the words, ``$3`` the pair ``-(M + z)``, ``$4``-``$11`` the activation pairs ``(x_j, x_{j+4})``
    of the first word then the second; ``$0`` the float32 sum of the sixteen products. Value ``j`` of a word
    (bits 4j..4j+3) and value ``j + 4`` (bits 16+4j..) land in the two halves of one register by a shift and one
    LOP3 (``(w & 0x000f000f) | M's bits``); each half then sums eight products before it is widened."""
    magic, one = {"bf16": ("0x43004300", "0x3F803F80"), "f16": ("0x64006400", "0x3C003C00")}[half]
    lines = [".reg .b32 t, v, one, nz, a, lo, hi;", ".reg .b16 h0, h1;", f"mov.b32 one, {one};",
             "mov.b32 nz, 0x80008000;"]  # -0.0: x * y + (-0.0) is x * y, signed zeros included
    first = True
    for word, xs in ((1, 4), (2, 8)):
        for j in range(4):
            if j == 0:
                lines.append(f"lop3.b32 v, ${word}, 0x000f000f, {magic}, 0xea;")
            else:
                lines.append(f"shr.u32 t, ${word}, {4 * j};")
                lines.append(f"lop3.b32 v, t, 0x000f000f, {magic}, 0xea;")
            lines.append(f"fma.rn.{half}x2 v, v, one, $3;")  # (q - z, q' - z), exact
            lines.append(f"fma.rn.{half}x2 a, v, ${xs + j}, {'nz' if first else 'a'};")
            first = False
    if half == "bf16":  # a bfloat16 is the top half of a float32
        lines += ["shl.b32 lo, a, 16;", "and.b32 hi, a, 0xffff0000;"]
    else:
        lines += ["mov.b32 {h0, h1}, a;", "cvt.f32.f16 lo, h0;", "cvt.f32.f16 hi, h1;"]
    lines.append("add.f32 $0, lo, hi;")
    return "{\n" + "\n".join(lines) + "\n}"


_PAIR_ASM = {torch.bfloat16: _pair_asm("bf16"), torch.float16: _pair_asm("f16")}
PAIR_MAGIC = {torch.bfloat16: 128.0, torch.float16: 1024.0}


@triton.jit
def prmt(a, b, SEL: tl.constexpr, EMULATE: tl.constexpr):
    """One PRMT: the four bytes of ``(a, b)`` (bytes 0-3 of a, 4-7 of b) that SEL's digits name, lowest first;
    under EMULATE (the interpreter) the same halves moved by integer ops, for the selectors used here."""
    if EMULATE:
        if SEL == 0x5410:
            return (a & 0xFFFF) | (b << 16)
        elif SEL == 0x7632:
            return ((a >> 16) & 0xFFFF) | (b & -65536)
        elif SEL == 0x3232:
            return ((a >> 16) & 0xFFFF) | (a & -65536)
        else:
            tl.static_assert(SEL == 0x1010)
            return (a & 0xFFFF) | (a << 16)
    else:
        return tl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SEL};", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def neg_offset_pairs(z, MAGIC16: tl.constexpr, EMULATE: tl.constexpr):
    """The int32 pairs ``(-(M + z), -(M + z))`` in half precision (bfloat16 where M is 128, float16 where 1024) of
    float32 integer zero points ``z``: exact, as they are small integers."""
    if MAGIC16 == 128.0:  # a bfloat16 is a float32's top half
        nz = (-MAGIC16 - z).to(tl.int32, bitcast=True)
        return prmt(nz, nz, 0x3232, EMULATE)
    else:
        nz = (-MAGIC16 - z).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        return prmt(nz, nz, 0x1010, EMULATE)


@triton.jit
def _x_pairs(xw, EMULATE: tl.constexpr):
    """The activation pairs ``(x_j, x_{j+4})`` j = 0..3 of the words whose inputs start at ``xw`` (int64 pointers
    to x's 16-bit values four a word): word w covers inputs 8w..8w+7, x's words 2w and 2w + 1."""
    x01 = tl.load(xw)
    x23 = tl.load(xw + 1)
    x0 = x01.to(tl.int32)
    x1 = (x01 >> 32).to(tl.int32)
    x2 = x23.to(tl.int32)
    x3 = (x23 >> 32).to(tl.int32)
    return (prmt(x0, x2, 0x5410, EMULATE), prmt(x0, x2, 0x7632, EMULATE), prmt(x1, x3, 0x5410, EMULATE),
            prmt(x1, x3, 0x7632, EMULATE))


@triton.jit
def half_bits(h, BF16: tl.constexpr):
    """The 16-bit float in ``h``'s low half (int32) as float32."""
    if BF16:
        return (h << 16).to(tl.float32, bitcast=True)
    else:
        return (h & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _word_products(w, nzf, p0, p1, p2, p3, BF16: tl.constexpr):
    """_pair_asm's sum for one word in float32 arithmetic (the interpreter's stand-in): ``(M + q) + nz`` is
    ``q - z``, times each pair's two activations."""
    r = tl.zeros(w.shape, dtype=tl.float32)
    for j in tl.static_range(4):
        p = p0 if j == 0 else (p1 if j == 1 else (p2 if j == 2 else p3))
        q_lo = ((w >> (4 * j)) & 0xF).to(tl.float32)
        q_hi = ((w >> (16 + 4 * j)) & 0xF).to(tl.float32)
        r += (q_lo + nzf) * half_bits(p, BF16) + (q_hi + nzf) * half_bits(p >> 16, BF16)
    return r


@triton.jit
def _wna16_gemv_pairs_kernel(
    x_ptr,  # [K / 4] int64: the activation's 16-bit values four a word
    qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, lock_ptr,
    N, K, CHUNKS_PER_SPLIT, num_splits,
    MAGIC16: tl.constexpr,  # M: 128.0 (bfloat16) or 1024.0 (float16)
    ASM: tl.constexpr,  # _pair_asm's PTX for the activation dtype
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE_LAST: tl.constexpr,
    EMULATE: tl.constexpr,  # the interpreter: the PTX's arithmetic in float32 Triton ops, the rest as compiled
):
    """4-bit weights, 16-bit activations: ``_pair_asm`` over each two words, then one multiply-add by the scale."""
    HALF: tl.constexpr = BLOCK_K // 16  # word pairs a step
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_w = tl.arange(0, HALF) * 2
    c_start = pid_s * CHUNKS_PER_SPLIT
    c_end = tl.minimum(c_start + CHUNKS_PER_SPLIT, K // BLOCK_K)
    acc = tl.zeros((HALF, BLOCK_N), dtype=tl.float32)
    for c in range(c_start, c_end):
        k0 = c * BLOCK_K
        w_ptr = qw_ptr + (k0 // 8 + offs_w)[:, None] * N + offs_n[None, :]
        w0 = tl.load(w_ptr, mask=n_ok[None, :], other=0)  # [HALF, BN]: even words
        w1 = tl.load(w_ptr + N, mask=n_ok[None, :], other=0)  # the odd ones
        xw = x_ptr + k0 // 4 + offs_w[:, None] * 2  # [HALF, 1]
        a0, a1, a2, a3 = _x_pairs(xw, EMULATE)
        b0, b1, b2, b3 = _x_pairs(xw + 2, EMULATE)  # the odd word: two int64 on
        g = k0 // GROUP
        s = tl.load(s_ptr + g * N + offs_n[None, :], mask=n_ok[None, :], other=0.0).to(tl.float32)  # [1, BN]
        z = tl.load(z_ptr + g * N + offs_n[None, :], mask=n_ok[None, :], other=0.0)
        nz = neg_offset_pairs(z, MAGIC16, EMULATE)
        if EMULATE:
            nzf = half_bits(nz >> 16, MAGIC16 == 128.0) + MAGIC16  # the high half's -(M + z), plus M
            r = (_word_products(w0, nzf, a0, a1, a2, a3, MAGIC16 == 128.0)
                 + _word_products(w1, nzf, b0, b1, b2, b3, MAGIC16 == 128.0))
        else:
            r = tl.inline_asm_elementwise(
                ASM, "=r,r,r,r,r,r,r,r,r,r,r,r",
                [w0, w1, nz, a0, a1, a2, a3, b0, b1, b2, b3],
                dtype=tl.float32, is_pure=True, pack=1)  # [HALF, BN]: each two words' sixteen products
        acc += r * s
    _write_row(tl.sum(acc, axis=0), out_ptr, part_ptr, lock_ptr, offs_n, n_ok, N, pid_n, pid_s, num_splits,
               REDUCE_LAST)


def gemv_block_k(group_size: int, k: int, bits: int) -> int | None:
    """The rows a GEMV step takes (dividing the group, so one scale row serves it), None where none fits."""
    pack = 32 // bits
    for bk in (128, 64, 32):
        if group_size % bk == 0 and k % bk == 0 and bk % pack == 0:
            return bk
    return None


def pairs_apply(x: torch.Tensor, bits: int) -> bool:
    """Whether the 4-bit kernels take their two-values-an-instruction PTX for ``x`` by default: NVIDIA GPUs from
    Ampere on (packed bfloat16 multiply-adds), compiled."""
    return (bits == 4 and x.dtype in _PAIR_ASM and x.is_cuda and torch.version.hip is None
            and not launch.triton_interpreted() and _ampere_or_later(x.device.index or 0))


@functools.cache
def _ampere_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 8


def wna16_gemv(
    x: torch.Tensor,  # [1, K]
    qweight: torch.Tensor,  # [K / (32 // bits), N] int32
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N] float, integers
    bits: int,
    group_size: int,
    block_n: int | None = None,  # None: 64 for wide outputs, else 128
    split_k: int | None = None,
    num_warps: int = 4,
    pairs: bool | None = None,  # the 4-bit pairs kernel; None: wherever ``pairs_apply``
) -> torch.Tensor:  # [1, N] in x's dtype
    """The one-row product, which ``wna16_matmul`` takes for one row; groups in order (no ``g_idx``) whose size a
    power-of-two step of 32-128 rows divides."""
    m, k = x.shape
    n = qweight.shape[1]
    bk = gemv_block_k(group_size, k, bits)
    if m != 1 or bk is None:
        raise ValueError(f"wna16_gemv: one row and a group size divisible by 32 (got {m} rows, group {group_size}, "
                         f"K {k})")
    if pairs is None:
        pairs = pairs_apply(x, bits)
    elif pairs and not (bits == 4 and x.dtype in _PAIR_ASM
                        and (pairs_apply(x, bits) or launch.triton_interpreted())):
        raise ValueError(f"wna16_gemv: the pairs kernel takes 4-bit weights and 16-bit activations on an NVIDIA GPU "
                         f"or in Triton's interpreter (got {bits} bits, {x.dtype} on {x.device})")
    chunks = k // bk
    if block_n is None:
        block_n = 64 if n >= 16384 else 128
    split = split_k
    if split is None:
        split = 1
        if x.device.type == "cuda":
            # Many short programs keep more loads in flight than few long ones (an H100 sweep of Llama-3-8B's
            # shapes): split the rows until about 16 programs an SM, each at least 4 steps long.
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            tiles = triton.cdiv(n, block_n)
            while tiles * split * 2 <= 16 * sms and chunks // (split * 2) >= 4:
                split *= 2
    per_split = triton.cdiv(chunks, split)
    split = triton.cdiv(chunks, per_split)
    tiles = triton.cdiv(n, block_n)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    locks = launch.split_counts(x.device, tiles) if split > 1 else None
    part = torch.empty((split, n), dtype=torch.float32, device=x.device) if split > 1 else out
    dest = out if locks is not None else part
    count = locks if locks is not None else out
    x = x.contiguous()
    if pairs:
        words = x.reshape(k)
        if words.storage_offset() % 4:  # the kernel reads x as int64 words
            words = words.clone()
        _wna16_gemv_pairs_kernel[(tiles, split)](
            words.view(torch.int64), qweight, scales, zeros, dest, part, count, n, k, per_split, split,
            MAGIC16=PAIR_MAGIC[x.dtype], ASM=_PAIR_ASM[x.dtype], GROUP=group_size, BLOCK_N=block_n, BLOCK_K=bk,
            REDUCE_LAST=locks is not None, EMULATE=launch.triton_interpreted(), num_warps=num_warps,
        )
    else:
        _wna16_gemv_kernel[(tiles, split)](
            x, qweight, scales, zeros, dest, part, count, n, k, per_split, split,
            GROUP=group_size, BITS=bits, BLOCK_N=block_n, BLOCK_K=bk, REDUCE_LAST=locks is not None,
            num_warps=num_warps,
        )
    if split > 1 and locks is None:  # no count buffer (first call inside a CUDA-graph capture): sum afterwards
        return part.sum(0, keepdim=True).to(x.dtype)
    return out
