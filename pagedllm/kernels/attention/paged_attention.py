"""Triton paged attention for flat mixed prefill/decode batches, with a split-KV (flash-decoding) path and its reduction."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.attention.attend_tile import _attend_ranges, chunk_descriptors
from pagedllm.kernels.attention.launch_config import (
    KernelConfig, choose_num_splits, default_config, device_sm_count,
)
from pagedllm.kernels.attention.decode_qk import store_new_token, transform_heads, transform_launch_args
from pagedllm.kernels.attention.fused_inputs import ChunkKV, NewKV, Rope
from pagedllm.kernels.attention.split_reduce import _reduce_splits_kernel
from pagedllm.kernels.launch import pdl_launch_args, prefetch_to_l2, wait_for_previous_kernel

# Requests scanned per step when a program looks up which request it serves.
_SEARCH_BLOCK = 128


@triton.jit
def _find_request(
    query_start_loc_ptr,  # [B + 1] int32
    num_reqs,
    pid,
    BLOCK_Q: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
):
    # Request i owns the program slots starting at qsl[i] // BLOCK_Q + i. The "+ i" makes the starts
    # strictly increasing and leaves each request at least ceil(q_len / BLOCK_Q) slots, so the grid
    # size T // BLOCK_Q + B is known on the host and the owner is the count of starts <= pid.
    # A vector count (one wave of loads) beats a binary search (log2(B) dependent loads).
    hits = tl.zeros([SEARCH_BLOCK], dtype=tl.int32)
    for base in range(0, num_reqs, SEARCH_BLOCK):
        idx = base + tl.arange(0, SEARCH_BLOCK)  # [SEARCH_BLOCK]
        valid = (idx >= 1) & (idx < num_reqs)
        qs = tl.load(query_start_loc_ptr + idx, mask=valid, other=0)
        hits += (valid & (qs // BLOCK_Q + idx <= pid)).to(tl.int32)
    return tl.sum(hits, axis=0)


@triton.jit
def _prefetch_tile(bt_row, k_head_ptr, v_head_ptr, tile_lo, kv_hi, stride_kb, stride_kp, stride_vb, stride_vp,
                   HEAD_SIZE: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, LINES: tl.constexpr,
                   LINE_ELEMS: tl.constexpr):
    """Ask L2 for the 128-byte lines (LINES a head, LINE_ELEMS elements each) of one tile's keys and values
    (positions tile_lo.. below kv_hi)."""
    pos = tile_lo + tl.arange(0, TILE_N)  # [TILE_N]
    valid = pos < kv_hi
    block = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)  # [TILE_N]
    cols = tl.arange(0, LINES) * LINE_ELEMS  # [LINES]
    mask = valid[:, None] & (cols < HEAD_SIZE)[None, :]
    in_block = (pos % BLOCK_SIZE)[:, None]
    prefetch_to_l2(k_head_ptr + block[:, None] * stride_kb + in_block * stride_kp + cols[None, :], mask)
    prefetch_to_l2(v_head_ptr + block[:, None] * stride_vb + in_block * stride_vp + cols[None, :], mask)


# Triton specialises integer arguments on == 1 and on divisibility by 16, compiling a variant for each
# kind it meets. Batch counts and the block table's row stride change with every step, so without
# this a long-running engine would keep compiling prefill variants in the middle of serving.
@triton.jit(do_not_specialize=["num_reqs", "num_splits", "stride_bt"])
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D] final output (unused when IS_SPLIT)
    part_acc_ptr,  # [T, Hq, num_splits, D] fp32 unnormalised partial outputs (IS_SPLIT only)
    part_ml_ptr,  # [T, Hq, num_splits, 2] fp32 (running max in log2 units, softmax denominator)
    q_ptr,  # [T, Hq, D], last dim contiguous
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D], last dim contiguous
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D], last dim contiguous
    block_table_ptr,  # [B, max_blocks_per_req] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    order_ptr,  # [B] int32 request of each decode program (ORDERED only)
    new_k_ptr,  # [T, Hkv, D] this step's keys, last dim contiguous (WRITE_KV and CHUNK_KV only)
    new_v_ptr,  # [T, Hkv, D] this step's values (WRITE_KV and CHUNK_KV only)
    slot_mapping_ptr,  # [T] int64 cache slot of each new token, < 0 for padding (WRITE_KV only)
    k_desc,  # (CHUNK_TMA) tensor descriptor of new_k as [T, Hkv * D]; else None
    v_desc,  # (CHUNK_TMA) the same for new_v
    inv_freq_ptr,  # [R/2] float32 rotary inverse frequencies (ROPE only)
    rope_scaling,  # cos/sin factor (ROPE only)
    num_reqs,
    num_q_heads,
    num_splits,  # partitions of each request's context (IS_SPLIT only)
    scale,
    soft_cap,
    window,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_kp, stride_kh,
    stride_vb, stride_vp, stride_vh,
    stride_bt,
    stride_nkt, stride_nkh, stride_nvt, stride_nvh,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_P2: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows = BLOCK_Q tokens x GROUP_P2 heads
    TILE_N: tl.constexpr,  # keys per inner iteration
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    DECODE_ONLY: tl.constexpr,  # every request has exactly one query token: program i serves request i
    ORDERED: tl.constexpr,  # (DECODE_ONLY) program i serves request order[i] instead
    WRITE_KV: tl.constexpr,  # (DECODE_ONLY) also store the new token's K/V into the cache
    CHUNK_KV: tl.constexpr,  # (not DECODE_ONLY) read the step's own keys from new_k/new_v (cached copy identical)
    CHUNK_TMA: tl.constexpr,  # (CHUNK_KV) ... through k_desc/v_desc
    ROPE: tl.constexpr,  # (WRITE_KV) q and the new k arrive unrotated: rotate them here (neox)
    ROT_HALF: tl.constexpr,  # rotary channels / 2 (ROPE only)
    EXACT: tl.constexpr,  # (ROPE) numerics.exact_rounding
    USE_GDC: tl.constexpr,  # launched with PDL: wait for the previous kernel first (kernels/launch.py)
    FP16_DOTS: tl.constexpr = False,  # (float8 cache, bf16 query) both products in float16, not bfloat16
    EARLY_LOADS: tl.constexpr = False,  # (DECODE_ONLY, USE_GDC) read the step's inputs before the PDL wait
    LINES: tl.constexpr = 1,  # (EARLY_LOADS) 128-byte lines of one cached head ...
    LINE_ELEMS: tl.constexpr = 64,  # ... of this many elements each
):
    if not EARLY_LOADS:
        wait_for_previous_kernel(USE_GDC, False)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_P2
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if DECODE_ONLY:
        # Token i is request i: no search, and at most one dependent load before the cache reads start.
        if ORDERED:
            req = tl.load(order_ptr + pid)
        else:
            req = pid
        q_start = req
        q_len = 1
        q_tok0 = 0
    else:
        req = _find_request(query_start_loc_ptr, num_reqs, pid, BLOCK_Q, SEARCH_BLOCK)
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        q_tok0 = (pid - (q_start // BLOCK_Q + req)) * BLOCK_Q
        # Surplus slots of the host-sized grid.
        if q_tok0 >= q_len:
            return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    # Row r is query token q_tok0 + r // GROUP_P2 under head kv_head * GROUP + r % GROUP_P2: the whole
    # group shares one KV head, so each K/V tile is loaded once and feeds every head of the group.
    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_tok = q_tok0 + rows // GROUP_P2  # [BLOCK_M] token index within the request
    row_head = kv_head * GROUP + rows % GROUP_P2  # [BLOCK_M] query head
    row_valid = (row_tok < q_len) & (rows % GROUP_P2 < GROUP)  # [BLOCK_M]
    q_pos = ctx_len + row_tok  # [BLOCK_M] position in the sequence
    dims = tl.arange(0, HEAD_SIZE_P2)  # [HEAD_SIZE_P2]
    dim_valid = dims < HEAD_SIZE
    tok = (q_start + row_tok).to(tl.int64)  # [BLOCK_M] flat token index

    # Keys this program needs: up to its last token's position (causal), from its first token's
    # window start. Padded rows clamp to the request so no key beyond seq_len is touched.
    kv_hi = tl.minimum(seq_len, ctx_len + q_tok0 + BLOCK_Q)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(ctx_len + q_tok0 - window + 1, 0)
    if IS_SPLIT:
        # This request's visible range, from its first tile, in num_splits pieces of whole tiles.
        range_lo = (kv_lo // TILE_N) * TILE_N
        split_len = tl.cdiv(tl.cdiv(kv_hi - range_lo, num_splits), TILE_N) * TILE_N
        kv_lo = tl.maximum(kv_lo, range_lo + split * split_len)
        kv_hi = tl.minimum(kv_hi, range_lo + (split + 1) * split_len)
    # Tiles start on TILE_N multiples, and split_len is one, so partitions never share a tile.
    tile_lo = (kv_lo // TILE_N) * TILE_N
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    k_head_ptr = k_cache_ptr + kv_head * stride_kh
    v_head_ptr = v_cache_ptr + kv_head * stride_vh
    if EARLY_LOADS:
        # The order, lengths and block table are written before the step's first launch and the cached
        # keys by earlier steps, never by the kernel waited on (the q/k norm launch writes q and only the
        # new token's slot): everything up to here ran while that kernel finished. L2 is also asked for
        # the first tile's lines; a hint only, so the new token's slot may be among them.
        _prefetch_tile(bt_row, k_head_ptr, v_head_ptr, tile_lo, kv_hi, stride_kb, stride_kp, stride_vb, stride_vp,
                       HEAD_SIZE, TILE_N, BLOCK_SIZE, LINES, LINE_ELEMS)
        wait_for_previous_kernel(USE_GDC, False)
    q_rows = q_ptr + tok[:, None] * stride_qt + row_head[:, None] * stride_qh  # [BLOCK_M, 1]
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_rows + dims[None, :], mask=q_mask, other=0.0)  # [BLOCK_M, HEAD_SIZE_P2]
    if ROPE:
        # Decode: the token sits at seq_len - 1. Every program of the request rotates its own copy of q.
        q = transform_heads(q, q_rows, q_mask, dims, dim_valid, seq_len - 1, inv_freq_ptr, rope_scaling, ROT_HALF, ROPE,
                            EXACT)

    if FP16_DOTS:
        # Float8 widens to float16 in one instruction per pair, to bfloat16 only through float32: with
        # q in float16, the tiles convert cheaply (and p keeps more mantissa). Saturate, not overflow.
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    if WRITE_KV:
        # The new token's slot is read only by the program whose range holds the last position, so
        # that program writes it first (saving the separate cache-write launch); the barrier makes the
        # stores of all its threads visible to its own tile loads below.
        slot = tl.load(slot_mapping_ptr + q_start).to(tl.int64)
        if (slot >= 0) & (kv_lo <= seq_len - 1) & (seq_len - 1 < kv_hi):
            store_new_token(q_start, slot, kv_head, dims, dim_valid, seq_len - 1, new_k_ptr, new_v_ptr, k_cache_ptr,
                            v_cache_ptr, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_kb, stride_kp,
                            stride_kh, inv_freq_ptr, rope_scaling, HEAD_SIZE_P2, BLOCK_SIZE, ROT_HALF, ROPE, EXACT)
        tl.debug_barrier()

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running denominator
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_P2], dtype=tl.float32)

    # Tiles wholly at or before the first row's position, and wholly inside the range, are visible to
    # every row: they skip all masking. Only the causal diagonal (and a window's edge) pays for it.
    if USE_WINDOW:
        full_hi = tile_lo
    else:
        full_hi = tl.minimum((ctx_len + q_tok0 + 1) // TILE_N, kv_hi // TILE_N) * TILE_N
        full_hi = tl.maximum(full_hi, tile_lo)
    # With CHUNK_KV, tiles wholly inside this step's own tokens (from the first tile start at or past the
    # cached prefix) read the new K/V rows directly; the prefix, and a tile straddling it, read the cache.
    if CHUNK_KV:
        chunk_lo = tl.cdiv(ctx_len, TILE_N) * TILE_N
        full_mid = tl.minimum(tl.maximum(chunk_lo, tile_lo), full_hi)
        masked_mid = tl.minimum(tl.maximum(chunk_lo, full_hi), kv_hi)
    else:
        full_mid = full_hi
        masked_mid = kv_hi
    chunk_tok0 = (q_start - ctx_len).to(tl.int64)
    desc_col = kv_head * HEAD_SIZE
    nk_head_ptr = new_k_ptr + kv_head * stride_nkh
    nv_head_ptr = new_v_ptr + kv_head * stride_nvh
    # Unmasked tiles, then the masked ones: each range through the cache first, then the chunk's rows.
    acc, m_i, l_i = _attend_ranges(
        acc, m_i, l_i, q, tile_lo, full_mid, full_hi, kv_hi, q_pos, bt_row, k_head_ptr, v_head_ptr,
        nk_head_ptr, nv_head_ptr, chunk_tok0, k_desc, v_desc, desc_col, scale, soft_cap, window,
        stride_kb, stride_kp, stride_vb, stride_vp, stride_nkt, stride_nvt,
        HEAD_SIZE, HEAD_SIZE_P2, TILE_N, BLOCK_SIZE, False, False, USE_SOFT_CAP, DOT_PRECISION, CHUNK_KV, CHUNK_TMA,
    )
    acc, m_i, l_i = _attend_ranges(
        acc, m_i, l_i, q, full_hi, masked_mid, kv_hi, kv_hi, q_pos, bt_row, k_head_ptr, v_head_ptr,
        nk_head_ptr, nv_head_ptr, chunk_tok0, k_desc, v_desc, desc_col, scale, soft_cap, window,
        stride_kb, stride_kp, stride_vb, stride_vp, stride_nkt, stride_nvt,
        HEAD_SIZE, HEAD_SIZE_P2, TILE_N, BLOCK_SIZE, True, USE_WINDOW, USE_SOFT_CAP, DOT_PRECISION, CHUNK_KV, CHUNK_TMA,
    )

    if IS_SPLIT:
        # Every (token, head, split) is written, empty partitions included (max -inf, sum 0), so the
        # reduction needs no knowledge of which partitions a request actually reached.
        part_row = (tok * num_q_heads + row_head) * num_splits + split  # [BLOCK_M]
        tl.store(
            part_acc_ptr + part_row[:, None] * HEAD_SIZE + dims[None, :],
            acc,
            mask=row_valid[:, None] & dim_valid[None, :],
        )
        tl.store(part_ml_ptr + part_row * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_valid)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + row_head[:, None] * stride_oh + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )


def kernel_strides(query, out, k_cache, v_cache, block_table, new_k, new_v) -> tuple[int, ...]:
    """The stride arguments of the attention kernels (stride_qt ... stride_nvh), in their order."""
    return (query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_table.stride(0), new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1))


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [B, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    *,
    num_reqs: int,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    num_splits: int | None = None,
    config: KernelConfig | None = None,
    new_kv: NewKV | None = None,
    rope: Rope | None = None,
    decode_order: torch.Tensor | None = None,  # [B] int32, a permutation of the requests
    chunk_kv: ChunkKV | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Attention of every query token over its request's paged context (cached prefix + causal self).

    ``num_splits`` forces the split-KV path (> 1) or the single pass (1); ``None`` lets the heuristic
    decide. Everything the launch needs comes from host ints, so no device-to-host sync happens.
    ``new_kv``: in a pure-decode batch (``max_query_len == 1``) the kernel stores the new keys and values
    into the cache itself before reading it; any other batch must have written them already
    (``reshape_and_cache``), and passing them is an error.
    ``rope``, with ``new_kv`` only: q and the new keys come unrotated and the kernel applies the neox
    rotary embedding at each request's last position.
    ``decode_order``: in a pure-decode batch, the order in which programs take the requests (longest
    context first balances a ragged batch); the results do not depend on it.
    ``chunk_kv``, outside pure-decode batches: this step's keys and values, already written to the cache. Tiles of the step's own tokens then read them
    from these rows rather than through the block table, by TMA where the device and the tensors allow
    (attend_tile.py); the values, hence the results, are the same.
    Over a float8 cache with a bfloat16 query both products are taken in float16: float8 widens to
    float16 in one instruction per pair, to bfloat16 only through float32 (decode 9-27% faster on an H200).
    A pure-decode launch under PDL reads its request, length and first tile's lines before waiting on
    the previous kernel (the q/k norm launch writes none of them).
    """
    num_tokens, num_q_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    assert num_q_heads % num_kv_heads == 0
    assert query.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    head_size_p2 = triton.next_power_of_2(head_size)
    group_p2 = triton.next_power_of_2(group)
    num_sms = device_sm_count(query.device)
    if num_splits is None:
        num_splits = choose_num_splits(num_reqs, max_query_len, max_seq_len, num_kv_heads, num_sms)
    cfg = config or default_config(
        head_size, group, max_query_len, max_seq_len=max_seq_len, num_reqs=num_reqs,
        num_kv_heads=num_kv_heads, num_sms=num_sms, split=num_splits > 1, cache_bytes=k_cache.element_size(),
    )
    assert cfg.block_m % group_p2 == 0 and cfg.block_m >= group_p2
    block_q = cfg.block_m // group_p2

    # No more partitions than tiles in the longest context: the rest would be empty for every request.
    num_splits = max(1, min(num_splits, triton.cdiv(max_seq_len, cfg.tile_n)))
    is_split = num_splits > 1

    if is_split:
        part_acc = torch.empty(
            (num_tokens, num_q_heads, num_splits, head_size), dtype=torch.float32, device=query.device
        )
        part_ml = torch.empty((num_tokens, num_q_heads, num_splits, 2), dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # never touched by the single-pass specialisation

    decode_only = max_query_len == 1
    if decode_only:
        assert num_tokens == num_reqs, "a pure-decode batch has one token per request"
    if new_kv is not None:
        assert decode_only, "the cache write is fused only into pure-decode launches"
        new_k, new_v, slot_mapping = new_kv.key, new_kv.value, new_kv.slot_mapping
        assert new_k.stride(-1) == 1 and new_v.stride(-1) == 1 and slot_mapping.shape[0] >= num_tokens
    elif chunk_kv is not None:
        assert not decode_only, "pure-decode launches read every key from the cache"
        new_k, new_v = chunk_kv.key, chunk_kv.value
        assert new_k.dtype == k_cache.dtype and new_v.dtype == v_cache.dtype
        assert new_k.stride(-1) == 1 and new_v.stride(-1) == 1 and new_k.shape[0] >= num_tokens
        slot_mapping = seq_lens
    else:
        new_k = new_v = query
        slot_mapping = seq_lens
    assert rope is None or new_kv is not None, "the rotary embedding is fused only with the decode cache write"
    transform_args, transform_consts = transform_launch_args(query, seq_lens, head_size, rope)
    k_desc = v_desc = None
    if chunk_kv is not None:
        # Not under a sliding window: Triton 3.6's TMA variant of the windowed kernel crashes ptxas (sm_90a).
        k_desc, v_desc = chunk_descriptors(new_k, new_v, num_tokens, cfg.tile_n, sliding_window is None)
    pdl = pdl_launch_args(query)
    # fp32 inputs would otherwise go through TF32 tensor cores and miss fp32 parity.
    dot_precision = "ieee" if query.dtype == torch.float32 else "tf32"
    fp16_dots = k_cache.element_size() == 1 and query.dtype == torch.bfloat16
    ordered = decode_only and decode_order is not None
    if ordered:
        assert decode_order.dtype == torch.int32 and decode_order.shape[0] >= num_reqs
    grid = (num_reqs if decode_only else num_tokens // block_q + num_reqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        out, part_acc, part_ml,
        query, k_cache, v_cache,
        block_table, seq_lens, query_start_loc,
        decode_order if ordered else seq_lens,
        new_k, new_v, slot_mapping,
        k_desc, v_desc,
        *transform_args,
        num_reqs, num_q_heads, num_splits,
        scale,
        soft_cap if soft_cap is not None else 1.0,
        sliding_window if sliding_window is not None else 0,
        *kernel_strides(query, out, k_cache, v_cache, block_table, new_k, new_v),
        HEAD_SIZE=head_size,
        HEAD_SIZE_P2=head_size_p2,
        GROUP=group,
        GROUP_P2=group_p2,
        BLOCK_M=cfg.block_m,
        TILE_N=cfg.tile_n,
        BLOCK_SIZE=block_size,
        USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=soft_cap is not None,
        IS_SPLIT=is_split,
        DOT_PRECISION=dot_precision,
        SEARCH_BLOCK=_SEARCH_BLOCK,
        DECODE_ONLY=decode_only,
        ORDERED=ordered,
        WRITE_KV=new_kv is not None,
        CHUNK_KV=chunk_kv is not None,
        CHUNK_TMA=k_desc is not None,
        **transform_consts,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"maxnreg": cfg.max_regs} if cfg.max_regs else {}),
        FP16_DOTS=fp16_dots,
        EARLY_LOADS=decode_only and bool(pdl.get("launch_pdl")),
        LINES=max(1, head_size_p2 * k_cache.element_size() // 128),
        LINE_ELEMS=128 // k_cache.element_size(),
        **pdl,
    )
    if is_split:
        _reduce_splits_kernel[(num_tokens, num_q_heads)](
            out, part_acc, part_ml,
            num_q_heads, num_splits,
            out.stride(0), out.stride(1),
            HEAD_SIZE=head_size,
            HEAD_SIZE_P2=head_size_p2,
            SPLITS_P2=triton.next_power_of_2(num_splits),
            num_warps=4 if head_size_p2 >= 128 else 2,
            **pdl,
        )
    return out
