"""The inner step of the paged-attention kernel: one tile of keys folded into a flash-style running softmax."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.launch import device_is_hopper_or_later, triton_interpreted

# A constexpr global, because jitted code may only read constexpr globals.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _load_kv_tile(
    ptrs,  # [TILE_N, HEAD_SIZE_P2] pointers into the K or V cache
    k_in,  # [TILE_N] bool, key inside the range (read only when MASKED)
    dims,  # [HEAD_SIZE_P2]
    MASKED: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_P2: tl.constexpr,
):
    # Interior tiles of a power-of-two head size load with no predicate at all.
    if MASKED:
        tile = tl.load(ptrs, mask=k_in[:, None] & (dims < HEAD_SIZE)[None, :], other=0.0)
    elif HEAD_SIZE == HEAD_SIZE_P2:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=(dims < HEAD_SIZE)[None, :], other=0.0)
    return tile


@triton.jit
def _attend_tile(
    acc,  # [BLOCK_M, HEAD_SIZE_P2] fp32 unnormalised output
    m_i,  # [BLOCK_M] fp32 running max, log2 units
    l_i,  # [BLOCK_M] fp32 running denominator
    q,  # [BLOCK_M, HEAD_SIZE_P2]
    n0,  # first key position of the tile
    kv_hi,  # keys at or past this position are never read
    q_pos,  # [BLOCK_M] sequence position of each row
    bt_row,  # -> [max_blocks_per_req] int32, this request's block table row
    k_head_ptr,  # -> K cache at this KV head: [num_blocks, BLOCK_SIZE, *, D]; the step's new keys when CHUNK
    v_head_ptr,  # -> V cache at this KV head; the step's new values when CHUNK
    chunk_tok0,  # (CHUNK) flat token index of key position 0: the row of position p is chunk_tok0 + p
    k_desc,  # (TMA) tensor descriptor of the new keys as [T, Hkv * D], blocks [TILE_N, D]; else None
    v_desc,  # (TMA) the same for the new values
    desc_col,  # (TMA) this KV head's first column: kv_head * D
    scale,
    soft_cap,
    window,
    stride_kb, stride_kp, stride_vb, stride_vp,  # (CHUNK) stride_kp / stride_vp: the new K / V token strides
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_P2: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,  # False only for tiles every row sees in full
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CHUNK: tl.constexpr,  # the tile lies in this step's own tokens: read it from the new K/V, not the cache
    TMA: tl.constexpr,  # (CHUNK) fetch those rows with the tensor memory accelerator (Hopper and later)
):
    k_pos = n0 + tl.arange(0, TILE_N)  # [TILE_N]
    dims = tl.arange(0, HEAD_SIZE_P2)  # [HEAD_SIZE_P2]
    if MASKED:
        k_in = k_pos < kv_hi
    else:
        k_in = k_pos >= 0  # unused
    if CHUNK and TMA:
        # One bulk copy per tile, issued by one thread: no per-element addresses in registers. Rows past
        # the descriptor's T read as zeros; rows of the next request are finite and masked below.
        tma_row = (chunk_tok0 + n0).to(tl.int32)
        k = k_desc.load([tma_row, desc_col])  # [TILE_N, D]
    elif CHUNK:
        # Contiguous rows: no block-table load and no block arithmetic (together ~20% of a plain
        # prompt kernel's time on an H200).
        tok = chunk_tok0 + k_pos.to(tl.int64)  # [TILE_N]
        k_off = tok[:, None] * stride_kp + dims[None, :]
        v_off = tok[:, None] * stride_vp + dims[None, :]
    else:
        # Per-key block lookup lets TILE_N differ from the cache block size.
        if MASKED:
            blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_in, other=0).to(tl.int64)  # [TILE_N]
        else:
            blk = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)  # [TILE_N]
        # [TILE_N, HEAD_SIZE_P2] offsets of this tile's rows, each a contiguous run of D elements.
        k_off = blk[:, None] * stride_kb + (k_pos % BLOCK_SIZE)[:, None] * stride_kp + dims[None, :]
        v_off = blk[:, None] * stride_vb + (k_pos % BLOCK_SIZE)[:, None] * stride_vp + dims[None, :]
    if not (CHUNK and TMA):
        k = _load_kv_tile(k_head_ptr + k_off, k_in, dims, MASKED, HEAD_SIZE, HEAD_SIZE_P2)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N] fp32
    if USE_SOFT_CAP:
        # tanh through exp2 of a non-positive argument: overflow-free and cheap.
        x = s * (scale / soft_cap)
        e = tl.exp2((-2.0 * LOG2E) * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        s = tl.where(x >= 0, t, -t) * (soft_cap * LOG2E)
    else:
        s = s * (scale * LOG2E)
    if MASKED:
        allowed = k_pos[None, :] <= q_pos[:, None]  # [BLOCK_M, TILE_N]
        if USE_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
        # A row with no visible key yet keeps max -inf; shift by 0 instead so exp2 yields 0, not NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = m_new
    p = tl.exp2(s - m_ref[:, None])  # [BLOCK_M, TILE_N]
    alpha = tl.exp2(m_i - m_ref)  # [BLOCK_M]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if CHUNK and TMA:
        v = v_desc.load([tma_row, desc_col])  # [TILE_N, D]
    else:
        v = _load_kv_tile(v_head_ptr + v_off, k_in, dims, MASKED, HEAD_SIZE, HEAD_SIZE_P2)  # [TILE_N, HEAD_SIZE_P2]
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_ranges(
    acc, m_i, l_i, q,
    lo,  # first tile start
    mid,  # tiles from here on lie in the step's own tokens (CHUNK_KV); before it they go through the cache
    hi,  # end of the range
    kv_hi, q_pos, bt_row, k_head_ptr, v_head_ptr,
    nk_head_ptr,  # -> the step's new keys at this KV head (CHUNK_KV)
    nv_head_ptr,  # -> the step's new values at this KV head (CHUNK_KV)
    chunk_tok0, k_desc, v_desc, desc_col, scale, soft_cap, window,
    stride_kb, stride_kp, stride_vb, stride_vp,
    stride_nkt, stride_nvt,  # token strides of the new keys / values
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_P2: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CHUNK_KV: tl.constexpr,
    CHUNK_TMA: tl.constexpr,
):
    # The tiles [lo, mid) through the block table, then (CHUNK_KV) [mid, hi) from the step's rows.
    for n0 in range(lo, mid, TILE_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, n0, kv_hi, q_pos, bt_row, k_head_ptr, v_head_ptr, chunk_tok0, k_desc, v_desc, desc_col,
            scale, soft_cap, window, stride_kb, stride_kp, stride_vb, stride_vp,
            HEAD_SIZE, HEAD_SIZE_P2, TILE_N, BLOCK_SIZE, MASKED, USE_WINDOW, USE_SOFT_CAP, DOT_PRECISION, False, False,
        )
    if CHUNK_KV:
        for n0 in range(mid, hi, TILE_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, n0, kv_hi, q_pos, bt_row, nk_head_ptr, nv_head_ptr, chunk_tok0, k_desc, v_desc,
                desc_col, scale, soft_cap, window, stride_kb, stride_nkt, stride_vb, stride_nvt,
                HEAD_SIZE, HEAD_SIZE_P2, TILE_N, BLOCK_SIZE, MASKED, USE_WINDOW, USE_SOFT_CAP, DOT_PRECISION, True,
                CHUNK_TMA,
            )
    return acc, m_i, l_i


def chunk_descriptors(
    new_k: torch.Tensor,  # [>= T, Hkv, D], last dim contiguous
    new_v: torch.Tensor,  # [>= T, Hkv, D]
    num_tokens: int,
    tile_n: int,
    enabled: bool = True,
) -> tuple[object, object]:
    """Tensor descriptors over the step's first ``num_tokens`` K/V rows as [T, Hkv * D] with [tile_n, D]
    blocks, for TMA loads of chunk tiles; (None, None) where TMA is off or cannot take these tensors.

    TMA exists on Hopper and later (Triton's interpreter emulates it). It needs a power-of-two head
    size (the block's width), a 16-byte aligned base and row stride, and heads side by side in a row.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_kv_heads, head_size = new_k.shape[1], new_k.shape[2]
    # On the GPU, the 16-bit K/V of D <= 128 that the H200 measurements covered; the interpreter takes all.
    on_device = (new_k.is_cuda and device_is_hopper_or_later(
        new_k.device.index if new_k.device.index is not None else torch.cuda.current_device())
                 and new_k.element_size() == 2 and head_size <= 128)
    usable = enabled and num_tokens > 0 and (on_device or triton_interpreted())
    usable = usable and head_size == triton.next_power_of_2(head_size) and head_size >= 16
    descs = []
    for t in (new_k, new_v):
        nbytes = t.element_size()
        if not (usable and t.stride(2) == 1 and t.stride(1) == head_size and t.data_ptr() % 16 == 0
                and (t.stride(0) * nbytes) % 16 == 0):
            return None, None
        descs.append(TensorDescriptor(t, [num_tokens, num_kv_heads * head_size], [t.stride(0), 1], [tile_n, head_size]))
    return descs[0], descs[1]
