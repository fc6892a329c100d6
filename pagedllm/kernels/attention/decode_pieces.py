"""Decode attention in even pieces: contexts cut into slices of one length that persistent programs take in turn.

A pure-decode launch with one program per (request, KV head) runs as long as its longest context
whenever the programs fit in one wave, and a ragged batch then leaves most slots idle for most of the
launch. Here every request's context is cut into pieces of one length per step (chosen on the device
from the step's total context; longer only past ``max_pieces`` pieces), the pieces are
numbered longest request first, and each program takes the next piece from a counter until none is
left, so every slot stays busy until the last piece starts. Only a request's last piece is shorter.

A request cut into several pieces is summed in the same launch: each piece stores its unnormalised
output with its running max and denominator, and the piece that arrives last (an atomic count per
request and KV head) folds all of them in piece order. The fold's order does not depend on which piece
arrived last, so the bits do not either; they differ from the one-pass kernel's only in that order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.attention.attend_tile import _attend_ranges
from pagedllm.kernels.attention.decode_qk import store_new_token, transform_heads, transform_launch_args
from pagedllm.kernels.attention.fused_inputs import NewKV, Rope
from pagedllm.kernels.attention.paged_attention import kernel_strides
from pagedllm.kernels.launch import pdl_launch_args, wait_for_previous_kernel

MAX_PIECES = 16
# A piece's length, chosen per step on the device (_piece_ends_kernel): about PIECES_PER_PROGRAM pieces
# for each program, in [_MIN_LEN, _MAX_LEN] keys. On an H200 it beat every fixed length in the same
# call (the best fixed one moved from 256 keys at 24 requests to 512 at 96-256).
PIECES_PER_PROGRAM = 2
_MIN_LEN = 128
_MAX_LEN = 2048
# Requests scanned per vector step when a program looks up which request a piece belongs to.
_SEARCH_BLOCK = 128


@triton.jit
def _piece_len(seq_len, base_tiles, MAX_PIECES: tl.constexpr, TILE_N: tl.constexpr):
    # The step's base length, or longer where that would make more than MAX_PIECES pieces. Counted in
    # tiles and multiplied out last, so that every piece starts on a tile (and the compiler knows it).
    return tl.maximum(base_tiles, tl.cdiv(tl.cdiv(seq_len, MAX_PIECES), TILE_N)) * TILE_N


@triton.jit
def _piece_ends_kernel(
    seq_lens_ptr,  # [B] int32
    order_ptr,  # [B] int32 request at each position (ORDERED only)
    ends_ptr,  # [B + 1] int32 out: pieces of positions 0..i together, then the base piece length in tiles
    num_reqs,
    target,  # pieces wanted per KV head
    MAX_PIECES: tl.constexpr,
    TILE_N: tl.constexpr,
    MIN_LEN: tl.constexpr,
    MAX_LEN: tl.constexpr,
    REQS_P2: tl.constexpr,
    ORDERED: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_previous_kernel(USE_GDC, True)
    pos = tl.arange(0, REQS_P2)  # [REQS_P2]
    valid = pos < num_reqs
    if ORDERED:
        req = tl.load(order_ptr + pos, mask=valid, other=0)
    else:
        req = pos
    seq_len = tl.load(seq_lens_ptr + req, mask=valid, other=0)
    # Long enough that per-piece costs stay small, short enough that a small batch still gives every
    # program something to do: the step's keys over the pieces wanted, in whole tiles.
    base_tiles = tl.cdiv(tl.cdiv(tl.sum(seq_len, axis=0), target), TILE_N)
    base_tiles = tl.minimum(tl.maximum(base_tiles, MIN_LEN // TILE_N), MAX_LEN // TILE_N)
    # At least one piece, so that a padding request (length 0) still writes its zeros.
    count = tl.maximum(tl.cdiv(seq_len, _piece_len(seq_len, base_tiles, MAX_PIECES, TILE_N)), 1)
    count = tl.where(valid, count, 0)
    tl.store(ends_ptr + pos, tl.cumsum(count, axis=0), mask=valid)
    tl.store(ends_ptr + num_reqs, base_tiles)


@triton.jit(do_not_specialize=["num_reqs"])
def _decode_pieces_kernel(
    out_ptr,  # [B, Hq, D]
    part_acc_ptr,  # [B * MAX_PIECES, Hq, D] fp32 unnormalised piece outputs, by piece number
    part_ml_ptr,  # [B * MAX_PIECES, Hq, 2] fp32 (running max in log2 units, denominator)
    grab_ptr,  # [Hkv] int32 next piece to take, per KV head; zero on entry and on exit
    done_ptr,  # [Hkv] int32 programs finished, per KV head; zero on entry and on exit
    arrive_ptr,  # [B, Hkv] int32 pieces finished per request position; zero on entry and on exit
    q_ptr,  # [B, Hq, D], last dim contiguous
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    block_table_ptr,  # [B, max_blocks_per_req] int32
    seq_lens_ptr,  # [B] int32
    order_ptr,  # [B] int32 request at each position (ORDERED only)
    ends_ptr,  # [B + 1] int32 from _piece_ends_kernel
    new_k_ptr,  # [B, Hkv, D] the step's keys (WRITE_KV only)
    new_v_ptr,  # [B, Hkv, D] the step's values (WRITE_KV only)
    slot_mapping_ptr,  # [B] int64 cache slot of each new token, < 0 for padding (WRITE_KV only)
    inv_freq_ptr,  # [R/2] float32 (ROPE only)
    rope_scaling,
    num_reqs,
    num_q_heads,
    scale,
    soft_cap,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_kp, stride_kh,
    stride_vb, stride_vp, stride_vh,
    stride_bt,
    stride_nkt, stride_nkh, stride_nvt, stride_nvh,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_P2: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= GROUP_P2 rows, the tensor-core minimum; row r is query head kv_head * GROUP + r
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    ORDERED: tl.constexpr,
    WRITE_KV: tl.constexpr,
    ROPE: tl.constexpr,
    ROT_HALF: tl.constexpr,
    EXACT: tl.constexpr,
    FP16_DOTS: tl.constexpr,  # (float8 cache, bf16 query) both products in float16 (paged_attention.py)
    MAX_PIECES: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_previous_kernel(USE_GDC, False)
    kv_head = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_valid = rows < GROUP
    row_head = kv_head * GROUP + tl.where(row_valid, rows, 0)  # [BLOCK_M] query head
    dims = tl.arange(0, HEAD_SIZE_P2)  # [HEAD_SIZE_P2]
    dim_valid = dims < HEAD_SIZE
    total = tl.load(ends_ptr + num_reqs - 1)
    base_tiles = tl.load(ends_ptr + num_reqs)
    k_head_ptr = k_cache_ptr + kv_head * stride_kh
    v_head_ptr = v_cache_ptr + kv_head * stride_vh

    item = tl.atomic_add(grab_ptr + kv_head, 1, sem="relaxed", scope="gpu")
    while item < total:
        # The piece's request: its position is the count of positions whose pieces all come before it.
        hits = tl.zeros([SEARCH_BLOCK], dtype=tl.int32)
        for base in range(0, num_reqs, SEARCH_BLOCK):
            idx = base + tl.arange(0, SEARCH_BLOCK)  # [SEARCH_BLOCK]
            ends = tl.load(ends_ptr + idx, mask=idx < num_reqs, other=2147483647)
            hits += (ends <= item).to(tl.int32)
        pos = tl.sum(hits, axis=0)
        first = tl.load(ends_ptr + pos - 1, mask=pos > 0, other=0)
        count = tl.load(ends_ptr + pos) - first
        piece = item - first
        if ORDERED:
            req = tl.load(order_ptr + pos)
        else:
            req = pos
        seq_len = tl.load(seq_lens_ptr + req)
        plen = _piece_len(seq_len, base_tiles, MAX_PIECES, TILE_N)
        kv_lo = piece * plen
        kv_hi = tl.minimum(seq_len, kv_lo + plen)

        q_rows = q_ptr + req.to(tl.int64) * stride_qt + row_head[:, None] * stride_qh  # [BLOCK_M, 1]
        q_mask = row_valid[:, None] & dim_valid[None, :]
        q = tl.load(q_rows + dims[None, :], mask=q_mask, other=0.0)  # [BLOCK_M, HEAD_SIZE_P2]
        if ROPE:
            q = transform_heads(q, q_rows, q_mask, dims, dim_valid, seq_len - 1, inv_freq_ptr, rope_scaling, ROT_HALF,
                                ROPE, EXACT)
        if FP16_DOTS:
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        if WRITE_KV:
            # The piece holding the new token's position stores its K/V before reading it.
            slot = tl.load(slot_mapping_ptr + req).to(tl.int64)
            if (slot >= 0) & (kv_lo <= seq_len - 1) & (seq_len - 1 < kv_hi):
                store_new_token(req.to(tl.int64), slot, kv_head, dims, dim_valid, seq_len - 1, new_k_ptr, new_v_ptr,
                                k_cache_ptr, v_cache_ptr, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_kb,
                                stride_kp, stride_kh, inv_freq_ptr, rope_scaling, HEAD_SIZE_P2, BLOCK_SIZE, ROT_HALF,
                                ROPE, EXACT)
            tl.debug_barrier()

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_SIZE_P2], dtype=tl.float32)
        q_pos = seq_len - 1 + rows * 0  # [BLOCK_M]: every key below seq_len is visible to the decode token
        bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
        # Pieces start on tile boundaries: whole tiles unmasked, then at most one partial tile.
        full_hi = kv_lo + ((kv_hi - kv_lo) // TILE_N) * TILE_N
        acc, m_i, l_i = _attend_ranges(
            acc, m_i, l_i, q, kv_lo, full_hi, full_hi, kv_hi, q_pos, bt_row, k_head_ptr, v_head_ptr,
            k_head_ptr, v_head_ptr, 0, None, None, 0, scale, soft_cap, 0,
            stride_kb, stride_kp, stride_vb, stride_vp, stride_nkt, stride_nvt,
            HEAD_SIZE, HEAD_SIZE_P2, TILE_N, BLOCK_SIZE, False, False, USE_SOFT_CAP, DOT_PRECISION, False, False,
        )
        acc, m_i, l_i = _attend_ranges(
            acc, m_i, l_i, q, full_hi, kv_hi, kv_hi, kv_hi, q_pos, bt_row, k_head_ptr, v_head_ptr,
            k_head_ptr, v_head_ptr, 0, None, None, 0, scale, soft_cap, 0,
            stride_kb, stride_kp, stride_vb, stride_vp, stride_nkt, stride_nvt,
            HEAD_SIZE, HEAD_SIZE_P2, TILE_N, BLOCK_SIZE, True, False, USE_SOFT_CAP, DOT_PRECISION, False, False,
        )

        out_rows = out_ptr + req.to(tl.int64) * stride_ot + row_head[:, None] * stride_oh + dims[None, :]
        if count == 1:
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            tl.store(out_rows, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            part_row = item.to(tl.int64) * num_q_heads + row_head  # [BLOCK_M]
            tl.store(part_acc_ptr + part_row[:, None] * HEAD_SIZE + dims[None, :], acc, mask=q_mask)
            tl.store(part_ml_ptr + part_row * 2, m_i, mask=row_valid)
            tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_valid)
            # Stores before the count (release); the last to count reads the others' after it (acquire).
            tl.debug_barrier()
            arrived = tl.atomic_add(arrive_ptr + pos * num_kv_heads + kv_head, 1, sem="acq_rel", scope="gpu")
            if arrived == count - 1:
                tl.debug_barrier()
                g = tl.arange(0, GROUP_P2)  # [GROUP_P2] the group's heads only: no padded rows to carry
                g_valid = g < GROUP
                g_head = kv_head * GROUP + tl.where(g_valid, g, 0)
                g_mask = g_valid[:, None] & dim_valid[None, :]
                m_run = tl.full([GROUP_P2], float("-inf"), dtype=tl.float32)
                l_run = tl.zeros([GROUP_P2], dtype=tl.float32)
                acc_run = tl.zeros([GROUP_P2, HEAD_SIZE_P2], dtype=tl.float32)
                for p in range(0, count):  # piece order: the same bits whichever piece came last
                    prow = (first + p).to(tl.int64) * num_q_heads + g_head  # [GROUP_P2]
                    m_p = tl.load(part_ml_ptr + prow * 2, mask=g_valid, other=float("-inf"), cache_modifier=".cg")
                    l_p = tl.load(part_ml_ptr + prow * 2 + 1, mask=g_valid, other=0.0, cache_modifier=".cg")
                    a_p = tl.load(part_acc_ptr + prow[:, None] * HEAD_SIZE + dims[None, :], mask=g_mask, other=0.0,
                                  cache_modifier=".cg")
                    m_new = tl.maximum(m_run, m_p)
                    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                    w_run = tl.exp2(m_run - m_ref)
                    w_p = tl.exp2(m_p - m_ref)
                    acc_run = acc_run * w_run[:, None] + a_p * w_p[:, None]
                    l_run = l_run * w_run + l_p * w_p
                    m_run = m_new
                l_safe = tl.where(l_run == 0.0, 1.0, l_run)
                g_out = out_ptr + req.to(tl.int64) * stride_ot + g_head[:, None] * stride_oh + dims[None, :]
                tl.store(g_out, (acc_run / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask)
                tl.atomic_xchg(arrive_ptr + pos * num_kv_heads + kv_head, 0, sem="relaxed", scope="gpu")
        item = tl.atomic_add(grab_ptr + kv_head, 1, sem="relaxed", scope="gpu")

    # The last program of this KV head to run out of pieces rewinds the counters for the next launch:
    # every other program has taken its last (empty) number by then.
    finished = tl.atomic_add(done_ptr + kv_head, 1, sem="acq_rel", scope="gpu")
    if finished == tl.num_programs(0) - 1:
        tl.atomic_xchg(grab_ptr + kv_head, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(done_ptr + kv_head, 0, sem="relaxed", scope="gpu")


class _Workspace:
    """Per device: piece partials and zeroed counters, shared by every launch on the device's stream."""

    def __init__(self, device: torch.device, rows: int, head_size: int, slots: int, heads: int) -> None:
        self.sizes = (rows, head_size, slots, heads)
        self.part_acc = torch.empty(rows * head_size, dtype=torch.float32, device=device)  # rows = pieces x Hq
        self.part_ml = torch.empty(rows * 2, dtype=torch.float32, device=device)
        self.arrive = torch.zeros(slots, dtype=torch.int32, device=device)  # slots = requests x Hkv
        self.grab = torch.zeros(heads, dtype=torch.int32, device=device)
        self.done = torch.zeros(heads, dtype=torch.int32, device=device)


_workspaces: dict[torch.device, _Workspace] = {}
# Outgrown workspaces stay allocated: CUDA graphs captured before the growth still point at them.
_outgrown: list[_Workspace] = []


def workspace_bytes(num_reqs: int, num_q_heads: int, num_kv_heads: int, head_size: int,
                    max_pieces: int = MAX_PIECES) -> int:
    """Device memory the pieces of a ``num_reqs`` decode batch need (partials and counters)."""
    return num_reqs * max_pieces * num_q_heads * (head_size + 2) * 4 + (num_reqs + 2) * num_kv_heads * 4


def _workspace(device: torch.device, num_reqs: int, num_q_heads: int, num_kv_heads: int, head_size: int,
               max_pieces: int) -> _Workspace:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # the key launches use
    need = (num_reqs * max_pieces * num_q_heads, head_size, num_reqs * num_kv_heads, num_kv_heads)
    ws = _workspaces.get(device)
    if ws is None or any(n > h for n, h in zip(need, ws.sizes)):
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"decode pieces need a workspace for {num_reqs} requests x {num_q_heads} heads; run the launch "
                "once outside CUDA-graph capture first"
            )
        if ws is not None:
            need = tuple(max(n, h) for n, h in zip(need, ws.sizes))
            _outgrown.append(ws)
        ws = _workspaces[device] = _Workspace(device, *need)
    return ws


def reserve(device: torch.device, num_reqs: int, num_q_heads: int, num_kv_heads: int, head_size: int) -> None:
    """Allocates the device's workspace for batches of up to ``num_reqs`` requests now."""
    _workspace(device, num_reqs, num_q_heads, num_kv_heads, head_size, MAX_PIECES)


def piece_ends(
    seq_lens: torch.Tensor,  # [B] int32
    decode_order: torch.Tensor | None,  # [B] int32 permutation, or None for batch order
    num_reqs: int,
    tile_n: int,
    programs_per_head: int,
    max_pieces: int = MAX_PIECES,
) -> torch.Tensor:  # [B + 1] int32
    """Pieces of the requests at positions 0..i together, positions taken in ``decode_order``, then the
    step's base piece length in tiles (about PIECES_PER_PROGRAM pieces a program). It depends on the
    step's batch alone, so one launch serves every layer of a step."""
    ends = torch.empty(num_reqs + 1, dtype=torch.int32, device=seq_lens.device)
    _piece_ends_kernel[(1,)](
        seq_lens, decode_order if decode_order is not None else seq_lens, ends, num_reqs,
        PIECES_PER_PROGRAM * programs_per_head,
        MAX_PIECES=max_pieces, TILE_N=tile_n, MIN_LEN=max(_MIN_LEN, tile_n),
        MAX_LEN=_MAX_LEN, REQS_P2=max(16, triton.next_power_of_2(num_reqs)),
        ORDERED=decode_order is not None, num_warps=4, **pdl_launch_args(seq_lens),
    )
    return ends


def decode_pieces_attention(
    query: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [B, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [B] int32
    ends: torch.Tensor,  # [B + 1] int32 from piece_ends with the same order, tile and lengths
    out: torch.Tensor,  # [B, Hq, D]
    *,
    num_reqs: int,
    scale: float,
    block_m: int,
    tile_n: int,
    num_warps: int,
    num_stages: int,
    programs_per_head: int,
    soft_cap: float | None = None,
    decode_order: torch.Tensor | None = None,
    new_kv: NewKV | None = None,
    rope: Rope | None = None,
    max_pieces: int = MAX_PIECES,
) -> torch.Tensor:  # [B, Hq, D]
    """One decode token per request over its paged context, in pieces (module docstring). Arguments mean
    what they mean for ``paged_attention``; no sliding window."""
    num_q_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    assert block_m >= triton.next_power_of_2(group)
    ws = _workspace(query.device, num_reqs, num_q_heads, num_kv_heads, head_size, max_pieces)
    if new_kv is not None:
        new_k, new_v, slot_mapping = new_kv.key, new_kv.value, new_kv.slot_mapping
    else:
        new_k = new_v = query
        slot_mapping = seq_lens
    transform_args, transform_consts = transform_launch_args(query, seq_lens, head_size, rope)
    _decode_pieces_kernel[(programs_per_head, num_kv_heads)](
        out, ws.part_acc, ws.part_ml, ws.grab, ws.done, ws.arrive,
        query, k_cache, v_cache, block_table, seq_lens,
        decode_order if decode_order is not None else seq_lens, ends,
        new_k, new_v, slot_mapping, *transform_args,
        num_reqs, num_q_heads, scale, soft_cap if soft_cap is not None else 1.0,
        *kernel_strides(query, out, k_cache, v_cache, block_table, new_k, new_v),
        HEAD_SIZE=head_size,
        HEAD_SIZE_P2=triton.next_power_of_2(head_size),
        GROUP=group,
        GROUP_P2=triton.next_power_of_2(group),
        BLOCK_M=block_m,
        TILE_N=tile_n,
        BLOCK_SIZE=block_size,
        USE_SOFT_CAP=soft_cap is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SEARCH_BLOCK=_SEARCH_BLOCK,
        ORDERED=decode_order is not None,
        WRITE_KV=new_kv is not None,
        **transform_consts,
        FP16_DOTS=k_cache.element_size() == 1 and query.dtype == torch.bfloat16,
        MAX_PIECES=max_pieces,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch_args(query),
    )
    return out
