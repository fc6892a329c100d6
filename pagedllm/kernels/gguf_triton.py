"""Triton product ``y = x @ W^T`` where W stays in GGUF (ggml) blocks on the GPU, decoded tile by tile in registers.

Each program owns a BLOCK_M x BLOCK_N output tile and walks the input dimension 32 elements at a time:
the 32-element run of every row of its tile is decoded from the row's blocks (a Q4_0/Q5_0/Q8_0 block,
or one sub-block of a Q4_K/Q6_K super-block) and multiplied on the tensor cores. The decoded values
are formed with the float operations of gguf-py's decoders (``d * q``; Q4_K's ``(d * sc) * q - dmin * m``;
Q6_K's ``(d * sc) * q``), so a float32 product equals the dense dequantized weight's up to summation
order; 16-bit activations see the weight rounded to their type, as the dense path stores it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# ggml type id -> (elements per block, bytes per block)
TRITON_BLOCKS: dict[int, tuple[int, int]] = {2: (32, 18), 6: (32, 22), 8: (32, 34), 12: (256, 144), 14: (256, 210)}
TRITON_TYPES: frozenset[int] = frozenset(TRITON_BLOCKS)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _f16(ptr, mask):
    """The little-endian half at ``ptr`` (two byte pointers' worth), as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return ((hi << 8) | lo).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode(rows, kb, i, mask, QTYPE: tl.constexpr):
    """Elements ``32 * kb + i`` of each row as float32: rows [BN, 1] byte pointers, i [1, 32] -> [BN, 32]."""
    if QTYPE == 8:  # Q8_0: half d, 32 int8
        base = rows + kb * 34
        d = _f16(base, mask)
        q = tl.load(base + 2 + i, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = d * q
    elif QTYPE == 2:  # Q4_0: half d, 16 bytes of nibbles (low nibbles are elements 0-15)
        base = rows + kb * 18
        d = _f16(base, mask)
        byte = tl.load(base + 2 + (i % 16), mask=mask, other=0)
        q = ((byte >> (4 * (i // 16)).to(tl.uint8)) & 15).to(tl.int32) - 8
        w = d * q.to(tl.float32)
    elif QTYPE == 6:  # Q5_0: half d, 32 high bits, 16 bytes of nibbles
        base = rows + kb * 22
        d = _f16(base, mask)
        hbyte = tl.load(base + 2 + i // 8, mask=mask, other=0)
        hbit = (hbyte >> (i % 8).to(tl.uint8)) & 1
        byte = tl.load(base + 6 + (i % 16), mask=mask, other=0)
        low = (byte >> (4 * (i // 16)).to(tl.uint8)) & 15
        q = (low | (hbit << 4)).to(tl.int32) - 16
        w = d * q.to(tl.float32)
    elif QTYPE == 12:  # Q4_K: half d, half dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        base = rows + (kb // 8) * 144
        j = kb % 8
        d = _f16(base, mask)
        dmin = _f16(base + 2, mask)
        a = tl.load(base + 4 + (j % 4), mask=mask, other=0).to(tl.int32)
        b = tl.load(base + 8 + (j % 4), mask=mask, other=0).to(tl.int32)
        c = tl.load(base + 12 + (j % 4), mask=mask, other=0).to(tl.int32)
        low_j = j < 4
        sc = tl.where(low_j, a & 63, (c & 15) | ((a >> 2) & 48))
        m = tl.where(low_j, b & 63, (c >> 4) | ((b >> 2) & 48))
        byte = tl.load(base + 16 + (j // 2) * 32 + i, mask=mask, other=0).to(tl.int32)
        q = (byte >> (4 * (j % 2))) & 15
        w = (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * m.to(tl.float32)
    else:  # Q6_K: 128 bytes low nibbles, 64 bytes high pairs, 16 int8 scales, half d
        tl.static_assert(QTYPE == 14)
        base = rows + (kb // 8) * 210
        j = kb % 8
        h = j // 4
        r = j % 4
        low = (tl.load(base + h * 64 + (r % 2) * 32 + i, mask=mask, other=0).to(tl.int32) >> (4 * (r // 2))) & 15
        high = (tl.load(base + 128 + h * 32 + i, mask=mask, other=0).to(tl.int32) >> (2 * r)) & 3
        q = (low | (high << 4)) - 32
        sc = tl.load(base + 192 + 2 * j + i // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        d = _f16(base + 208, mask)
        w = (d * sc) * q.to(tl.float32)
    return w


@triton.jit
def _gguf_mm_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, stride_xm, stride_ym,
    QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    i = tl.arange(0, 32)[None, :]
    mask_m = rm[:, None] < M
    mask_n = rn[:, None] < N
    rows = w_ptr + rn[:, None].to(tl.int64) * row_bytes  # [BN, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // 32):
        w = _decode(rows, kb, i, mask_n, QTYPE)  # [BN, 32] float32
        xk = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + kb * 32 + i, mask=mask_m, other=0.0)
        if IEEE:
            acc += tl.dot(xk, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(xk, tl.trans(w.to(xk.dtype)))
    out = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], out, mask=mask_m & (rn[None, :] < N))


def gguf_mm_triton(
    x: torch.Tensor,  # [M, K] float32/float16/bfloat16
    qweight: torch.Tensor,  # [N, K // block * bytes per block] uint8, rows of ggml blocks
    qtype: int,
) -> torch.Tensor:  # [M, N] in x's dtype
    qtype = int(qtype)
    if qtype not in TRITON_BLOCKS:
        raise ValueError(f"qtype {qtype} has no Triton kernel; supported ggml types: {sorted(TRITON_BLOCKS)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be a 2-D uint8 tensor of blocks, got {qweight.dtype} {tuple(qweight.shape)}")
    block, nbytes = TRITON_BLOCKS[qtype]
    M, K = x.shape
    N, row_bytes = qweight.shape
    if K % block or row_bytes != K // block * nbytes:
        raise ValueError(
            f"x's K={K} must be a multiple of {block} with {K // block * nbytes} bytes per weight row; "
            f"qweight rows hold {row_bytes}"
        )
    x = x.contiguous()
    qweight = qweight.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    block_n = 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _gguf_mm_kernel[grid](
        x, qweight, y, M, N, K, row_bytes, x.stride(0), y.stride(0),
        QTYPE=qtype, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=x.dtype == torch.float32,
    )
    return y
