"""Triton alignment of a step's routed (token, slot) pairs by expert: one program, no host sync.

The pairs are flattened (pair ``p`` is token ``p // top_k``, slot ``p % top_k``) and laid out grouped by
expert, in increasing expert id and, within an expert, in pair order; each expert's group is padded to a
multiple of ``BLOCK_M`` with the sentinel ``num_pairs``, so every ``BLOCK_M`` rows of the layout belong to
one expert and a grouped GEMM program reads one expert's weights. Buffers are sized from the shapes
alone (``max_padded_pairs``), so the launch never waits for the counts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_align_kernel(
    topk_ids_ptr,  # [P] int32 expert of each pair
    sorted_ids_ptr,  # [max_blocks * BLOCK_M] int32 out: pair indices grouped by expert, padding = P
    expert_ids_ptr,  # [max_blocks] int32 out: each block's expert, -1 past the end
    num_padded_ptr,  # [1] int32 out: rows of the layout in use (a multiple of BLOCK_M)
    num_pairs,  # P
    max_blocks,
    E_POW2: tl.constexpr,  # experts, rounded up to a power of two
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,  # pairs per loop iteration; CHUNK x E_POW2 one-hot tiles
):
    experts = tl.arange(0, E_POW2)
    # Pairs per expert.
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [E_POW2] end of each expert's group
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)

    # A block's expert: how many groups end at or before the block's first row.
    for b0 in range(0, max_blocks, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        first_row = blocks * BLOCK_M
        owner = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        owner = tl.where(first_row < total, owner, -1)
        tl.store(expert_ids_ptr + blocks, owner, mask=blocks < max_blocks)

    for r0 in range(0, max_blocks * BLOCK_M, CHUNK):
        rows = r0 + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + rows, tl.zeros([CHUNK], dtype=tl.int32) + num_pairs, mask=rows < max_blocks * BLOCK_M)
    # The padding above and the pairs below may share addresses, written by different threads.
    tl.debug_barrier()

    # Each pair's row: its group's start, plus the same-expert pairs before it.
    next_row = ends - padded  # [E_POW2]
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_POW2]
        before = tl.cumsum(onehot, axis=0) - onehot
        rows = tl.sum((before + next_row[None, :]) * onehot, axis=1)
        tl.store(sorted_ids_ptr + rows, offs, mask=offs < num_pairs)
        next_row += tl.sum(onehot, axis=0)


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows the aligned layout can need: every pair, plus less than a block for each expert in use."""
    return num_pairs + min(num_pairs, num_experts) * (block_m - 1)


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [T, K] int32
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted pair ids [max_blocks * block_m] int32, block experts [max_blocks] int32, rows in use [1] int32)."""
    if topk_ids.dtype != torch.int32:
        raise ValueError(f"topk_ids must be int32; got {topk_ids.dtype}")
    num_pairs = topk_ids.numel()
    max_blocks = triton.cdiv(max_padded_pairs(num_pairs, num_experts, block_m), block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    e_pow2 = triton.next_power_of_2(num_experts)
    chunk = max(16, min(256, 4096 // e_pow2))
    _moe_align_kernel[(1,)](topk_ids.contiguous(), sorted_ids, expert_ids, num_padded, num_pairs, max_blocks,
                            E_POW2=e_pow2, BLOCK_M=block_m, CHUNK=chunk, num_warps=4)
    return sorted_ids, expert_ids, num_padded
