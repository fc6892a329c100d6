"""Random paged attention batches for backend tests: shuffled physical blocks and a NaN-poisoned cache copy."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from pagedllm.attention.metadata import AttentionMetadata


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
    poisoned cache, metadata factory). In the poisoned copy every slot that holds no token of any
    request is NaN, so a backend that reads past a sequence's end or outside its block table shows up
    as NaN. The factory makes a fresh AttentionMetadata per call (backends cache per-step plans in it).
    ``cache_dtype``: the caches' element type when it differs from ``dtype`` (float8); with
    ``kv_on_cache_grid`` the new keys and values are values that type holds exactly, so that writing
    them involves no rounding (Triton's interpreter rounds float8 wrongly across a power of two).
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in reqs]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    spare = int(perm[-1])  # a never-written block fills the table's unused tail
    block_table = torch.full((len(reqs), max(blocks_per_req) + 2), spare, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = perm[used : used + n]
        used += n

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    kv_cache = rnd(2, num_blocks, block_size, num_kv_heads, head_size)
    live = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    slots, qsl = [], [0]
    for i, (ctx, q_len) in enumerate(reqs):
        pos = torch.arange(seq_lens[i])
        slot = block_table[i, pos // block_size].long() * block_size + pos % block_size
        live[slot] = True
        slots.append(slot[ctx:])
        qsl.append(qsl[-1] + q_len)
    num_tokens = qsl[-1]
    query = rnd(num_tokens + pad, num_heads, head_size)
    key = rnd(num_tokens + pad, num_kv_heads, head_size)
    value = rnd(num_tokens + pad, num_kv_heads, head_size)
    if cache_dtype is not None and kv_on_cache_grid:
        key, value = key.to(cache_dtype).to(dtype), value.to(cache_dtype).to(dtype)
    slot_mapping = torch.cat(slots + [torch.full((pad,), -1, dtype=torch.long)])
    poisoned = kv_cache.clone()
    poisoned.view(2, -1, num_kv_heads, head_size)[:, ~live] = float("nan")
    if cache_dtype is not None:
        kv_cache, poisoned = kv_cache.to(cache_dtype), poisoned.to(cache_dtype)

    def metadata() -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=len(reqs),
            max_query_len=max(q for _, q in reqs),
            max_seq_len=max(seq_lens),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=block_table.to(device),
            slot_mapping=slot_mapping.to(device),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )

    to = lambda t: t.to(device)  # noqa: E731
    return to(query), to(key), to(value), to(kv_cache), to(poisoned), metadata
