"""Paged attention batches for tests: scattered block tables, one step's metadata, and random mixed
batches with a NaN-poisoned cache copy. The one place tests build block tables and slot mappings."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from pagedllm.attention.metadata import AttentionMetadata


def scattered_block_tables(
    seq_lens: Sequence[int], block_size: int, gen: torch.Generator, num_blocks: int | None = None
) -> tuple[list[list[int]], list[int]]:
    """Each sequence's blocks, taken in the order of a random permutation of a pool of ``num_blocks``
    (default: two more than the sequences need), so that a bug assuming contiguous or ordered blocks
    shows up. Returns (tables, the pool's free blocks)."""
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 2 if num_blocks is None else num_blocks
    perm = torch.randperm(num_blocks, generator=gen, device=gen.device).tolist()
    tables, used = [], 0
    for n in blocks_per_req:
        tables.append(perm[used : used + n])
        used += n
    return tables, perm[used:]


def step_metadata(
    block_tables: Sequence[Sequence[int]],
    starts: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    device: torch.device | str = "cpu",
    pad: int = 0,
    width: int | None = None,
    fill: int = 0,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """One step of requests that already hold ``starts[i]`` tokens and add ``query_lens[i]``.

    Returns (positions [T + pad] int64, metadata). ``pad`` padding tokens follow the batch (slot -1,
    position 0); table rows are widened to ``width`` columns (default: the longest table) with ``fill``
    (a never-written block, where a test wants a read past a table's end to show).
    """
    width = max(len(t) for t in block_tables) if width is None else width
    table = torch.tensor([list(t) + [fill] * (width - len(t)) for t in block_tables], dtype=torch.int32)
    positions, slots, qsl, seq_lens = [], [], [0], []
    for i, (start, q_len) in enumerate(zip(starts, query_lens)):
        pos = torch.arange(start, start + q_len)
        positions.append(pos)
        slots.append(table[i, pos // block_size].long() * block_size + pos % block_size)
        qsl.append(qsl[-1] + q_len)
        seq_lens.append(start + q_len)
    positions.append(torch.zeros(pad, dtype=torch.long))
    slots.append(torch.full((pad,), -1, dtype=torch.long))
    md = AttentionMetadata(
        num_actual_tokens=qsl[-1],
        num_reqs=len(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    return torch.cat(positions).to(device), md


def sequence_slots(md: AttentionMetadata, i: int, block_size: int) -> torch.Tensor:
    """The cache slots of request i's whole sequence (cached prefix and new tokens), in order."""
    pos = torch.arange(md.seq_lens_cpu[i], device=md.block_table.device)
    return md.block_table[i, pos // block_size].long() * block_size + pos % block_size


def build_paged_batch(
    reqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    pad: int = 0,
    device: torch.device | str = "cpu",
    cache_dtype: torch.dtype | None = None,
    kv_on_cache_grid: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Callable[[], AttentionMetadata]]:
    """A mixed batch; ``reqs`` is (cached context, new tokens) per request, ``pad`` padding tokens follow.

    Returns (query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, D], cache [2, blocks, bs, Hkv, D],
    poisoned cache, metadata factory). The cached prefixes are the cache's random contents at their
    slots. In the poisoned copy every slot that holds no token of any request is NaN, so a backend that
    reads past a sequence's end or outside its block table shows up as NaN. The factory makes a fresh
    AttentionMetadata per call (backends cache per-step plans in it).
    ``cache_dtype``: the caches' element type when it differs from ``dtype`` (float8); with
    ``kv_on_cache_grid`` the new keys and values are values that type holds exactly, so that writing
    them involves no rounding (Triton's interpreter rounds float8 wrongly across a power of two).
    Random values are drawn on ``device`` (on a GPU, large batches would take seconds on the host), so
    a seed gives the same batch on every CPU, and on every GPU, but not the same on both.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    seq_lens = [c + q for c, q in reqs]
    tables, free = scattered_block_tables(seq_lens, block_size, gen)
    num_blocks = sum(map(len, tables)) + len(free)
    width = max(len(t) for t in tables) + 2
    starts, query_lens = [c for c, _ in reqs], [q for _, q in reqs]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    kv_cache = rnd(2, num_blocks, block_size, num_kv_heads, head_size)
    num_tokens = sum(query_lens)
    query = rnd(num_tokens + pad, num_heads, head_size)
    key = rnd(num_tokens + pad, num_kv_heads, head_size)
    value = rnd(num_tokens + pad, num_kv_heads, head_size)
    if cache_dtype is not None and kv_on_cache_grid:
        key, value = key.to(cache_dtype).to(dtype), value.to(cache_dtype).to(dtype)

    def metadata() -> AttentionMetadata:
        return step_metadata(tables, starts, query_lens, block_size, device, pad, width, fill=free[-1])[1]

    md = metadata()
    live = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    for i in range(len(reqs)):
        live[sequence_slots(md, i, block_size)] = True
    poisoned = kv_cache.clone()
    poisoned.view(2, -1, num_kv_heads, head_size)[:, ~live] = float("nan")
    if cache_dtype is not None:
        kv_cache, poisoned = kv_cache.to(cache_dtype), poisoned.to(cache_dtype)
    return query, key, value, kv_cache, poisoned, metadata
