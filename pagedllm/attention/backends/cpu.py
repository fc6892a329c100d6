"""The CPU attention backend: batched decode and per-request prefill over the paged cache, with gather
indices and masks built once per step and shared by every layer.

The reference backend (torch_ref) rebuilds block indices and boolean masks in every layer, gathers
K and V and zeroes the gathered values of masked positions; at 18 layers and a 32-wide decode that
bookkeeping and copying, not the attention arithmetic, is most of its time. Here a step plan holds,
per sliding window (Gemma 3 has two: local and global), the flat cache slots each request reads and
an additive 0 / -inf bias:

- decode requests (one query token) are batched: on a float32 cache one C call per layer
  (``kernels/cpu/decode_attention``) reads their visible keys and values in place; otherwise one gather
  of K, ``baddbmm`` (scale and mask in one call) and softmax, then the probability-weighted sum of V
  (an ``embedding_bag`` over the value rows in place, or a gathered ``bmm`` for other dtypes);
- prefill chunks run per request, in query tiles so the score matrix stays bounded, with torch's
  fused ``scaled_dot_product_attention`` (the explicit products when there is a soft cap), against
  keys taken straight from this step's K/V when the chunk has no cached prefix, else gathered.

Padded key positions point at a slot the request itself wrote (its last position), so what is read
there is a real value, and its probability is exactly zero: unlike torch_ref, no masked fill of V
is needed to keep never-written (NaN) slots out.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend, AttentionImpl
from pagedllm.attention.backends.torch_ref import to_cache_dtype, write_kv_cache
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.cpu import decode_attention

# Query rows of a prefill chunk attended to at once: bounds the mask (and, with a soft cap, the
# [Hq, rows, keys] float32 scores: 4 heads x 1024 x 8192 keys = 128 MiB) while keeping products large.
_PREFILL_TILE = 1024


@dataclass
class _DecodeGroup:
    """The batched decode requests' keys under one sliding window."""

    slots: torch.Tensor  # [Bd * S] int64, flat cache slots, request-major
    num_keys: int  # S
    counts: torch.Tensor  # [Bd] int64, visible keys per request: its first counts[b] slots
    # (Hq, Hkv) -> [Bd * Hq, S] int64 rows of the cache viewed as [slots * Hkv, D] that query head
    # (b, h) reads: the bags of the probability-weighted value sum (see CpuAttentionImpl._decode).
    value_rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _bias: torch.Tensor | None = None

    @property
    def bias(self) -> torch.Tensor:  # [Bd, 1, S] float32, 0 where the key is visible, -inf elsewhere
        """Made at first use: the C decode kernel reads ``counts`` instead, and a step builds two groups."""
        if self._bias is None:
            hidden = torch.arange(self.num_keys)[None, :] >= self.counts[:, None]
            self._bias = torch.zeros(len(self.counts), 1, self.num_keys).masked_fill_(hidden[:, None, :], float("-inf"))
        return self._bias

    def value_rows_for(self, num_heads: int, num_kv_heads: int) -> torch.Tensor:  # [Bd * Hq, S] int64
        rows = self.value_rows.get((num_heads, num_kv_heads))
        if rows is None:
            slots = self.slots.view(-1, 1, 1, self.num_keys)  # [Bd, 1, 1, S]
            kv_head = torch.arange(num_kv_heads).view(1, -1, 1, 1)
            rows = (slots * num_kv_heads + kv_head).expand(-1, -1, num_heads // num_kv_heads, -1)
            rows = self.value_rows[(num_heads, num_kv_heads)] = rows.reshape(-1, self.num_keys)
        return rows


@dataclass
class _PrefillChunk:
    """One request's prompt chunk (query length > 1) under one sliding window."""

    start: int  # first token row of the chunk in the flat batch
    end: int
    first_key: int  # position of the first key any query of the chunk sees
    seq_len: int  # the request's length after this step; keys are positions first_key .. seq_len - 1
    slots: torch.Tensor | None  # [S] int64 cache slots, or None: every key is new in this step


@dataclass
class _StepPlan:
    """Everything about this step's batch that does not depend on the layer, per sliding window."""

    block_size: int
    decode_reqs: list[int]  # request indices with one query token
    decode_rows: torch.Tensor | None  # [Bd] int64 token rows of the decode requests; None when there are none
    decode_all: bool  # the decode requests are exactly rows 0 .. T-1, in order (a pure-decode step)
    decode_lens: torch.Tensor | None  # [Bd] int64 sequence lengths of the decode requests
    prefill_reqs: list[int] = field(default_factory=list)
    decode: dict[int | None, _DecodeGroup] = field(default_factory=dict)
    prefill: dict[int | None, list[_PrefillChunk]] = field(default_factory=dict)


def _build_plan(md: AttentionMetadata, block_size: int) -> _StepPlan:
    qsl, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
    decode_reqs = [i for i in range(md.num_reqs) if qsl[i + 1] - qsl[i] == 1]
    prefill_reqs = [i for i in range(md.num_reqs) if qsl[i + 1] - qsl[i] > 1]
    rows = [qsl[i] for i in decode_reqs]
    decode_all = len(decode_reqs) == md.num_actual_tokens and rows == list(range(len(rows)))
    return _StepPlan(
        block_size=block_size,
        decode_reqs=decode_reqs,
        decode_rows=torch.tensor(rows, dtype=torch.int64) if rows else None,
        decode_all=decode_all,
        decode_lens=torch.tensor([seq_lens[i] for i in decode_reqs], dtype=torch.int64) if rows else None,
        prefill_reqs=prefill_reqs,
    )


def _slots_of(
    block_table: torch.Tensor,  # [B', max_blocks] int32
    positions: torch.Tensor,  # [B', S] int64, each inside its request's sequence
    block_size: int,
) -> torch.Tensor:  # [B', S] int64 flat cache slots
    blocks = block_table.long().gather(1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size


def _decode_group(
    md: AttentionMetadata, decode_reqs: list[int], lens: torch.Tensor, window: int | None, block_size: int
) -> _DecodeGroup:
    # Request b's query sits at position lens[b] - 1 and sees keys from lens[b] - window on (HF's
    # convention: key position > query position - window), or from 0 without a window. numpy: a few
    # small arrays, built twice a step (local and global windows), where torch's per-call cost dominates.
    n = lens.numpy()
    first = np.maximum(n - window, 0) if window is not None else np.zeros_like(n)
    count = n - first
    num_keys = int(count.max())
    j = np.arange(num_keys)
    # Invisible positions read the request's own last token: written, finite, and weighted by exactly 0.
    pos = np.where(j[None, :] < count[:, None], first[:, None] + j[None, :], (n - 1)[:, None])  # [Bd, S]
    table = md.block_table.cpu().numpy()
    if len(decode_reqs) != md.num_reqs:
        table = table[decode_reqs]
    blocks = np.take_along_axis(table, pos // block_size, axis=1).astype(np.int64)
    slots = torch.from_numpy((blocks * block_size + pos % block_size).reshape(-1))
    return _DecodeGroup(slots, num_keys, torch.from_numpy(count))


def _prefill_chunks(md: AttentionMetadata, reqs: list[int], window: int | None, block_size: int) -> list[_PrefillChunk]:
    qsl, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
    chunks = []
    for i in reqs:
        start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
        first_query = seq_len - (end - start)
        first_key = max(0, first_query - window + 1) if window is not None else 0
        slots = None
        if first_query > 0:  # a cached prefix: the keys come from the cache
            pos = torch.arange(first_key, seq_len)[None, :]
            slots = _slots_of(md.block_table[i : i + 1].cpu(), pos, block_size).view(-1)
        chunks.append(_PrefillChunk(start, end, first_key, seq_len, slots))
    return chunks


def _step_plan(md: AttentionMetadata, block_size: int, window: int | None) -> _StepPlan:
    """The step's plan, built by the first layer that asks and extended once per new window."""
    key = ("cpu_attention", block_size)
    plan = md.step_cache.get(key)
    if plan is None:
        plan = md.step_cache[key] = _build_plan(md, block_size)
    if window not in plan.decode and plan.decode_lens is not None:
        plan.decode[window] = _decode_group(md, plan.decode_reqs, plan.decode_lens, window, block_size)
    if window not in plan.prefill:
        plan.prefill[window] = _prefill_chunks(md, plan.prefill_reqs, window, block_size)
    return plan


def _prefill_bias(
    first_query: int, rows: int, first_key: int, num_keys: int, window: int | None
) -> torch.Tensor:  # [rows, num_keys] float32 additive mask: causal, and the window when there is one
    q_pos = torch.arange(first_query, first_query + rows)[:, None]
    k_pos = torch.arange(first_key, first_key + num_keys)[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    return torch.zeros(rows, num_keys).masked_fill_(hidden, float("-inf"))


class CpuAttentionImpl(AttentionImpl):
    """Same contract as torch_ref (rows past ``num_actual_tokens`` come back as zeros), faster on CPU."""

    def _probs(
        self,
        q: torch.Tensor,  # [N * Hkv, R, D] float32: the R query rows (heads x tokens) of each KV head
        k: torch.Tensor,  # [N * Hkv, S, D] float32
        bias: torch.Tensor,  # broadcastable to [N * Hkv, R, S] float32: 0 where visible, -inf elsewhere
    ) -> torch.Tensor:  # [N * Hkv, R, S] float32
        """softmax(q k^T * scale (soft-capped) + bias)."""
        if self.logits_soft_cap is None:
            # bias + scale * (q k^T) in one call; adding 0 or -inf is exact, so the mask costs no rounding.
            scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=self.scale)
        else:
            cap = self.logits_soft_cap
            scores = torch.bmm(q, k.transpose(1, 2)).mul_(self.scale).div_(cap).tanh_().mul_(cap).add_(bias)
        return torch.softmax(scores, dim=-1)

    def _decode(
        self,
        query: torch.Tensor,  # [Bd, Hq, D]
        k_flat: torch.Tensor,  # [num_slots, Hkv, D]
        v_flat: torch.Tensor,  # [num_slots, Hkv, D]
        group: _DecodeGroup,
    ) -> torch.Tensor:  # [Bd, Hq, D] float32
        bd, hq, d = query.shape
        hkv, s = self.num_kv_heads, group.num_keys
        if (k_flat.dtype == torch.float32 and v_flat.dtype == torch.float32 and query.dtype == torch.float32
                and decode_attention.available()):
            # One C call reads the visible keys and values in place (see kernels/cpu/decode_attention.py).
            return decode_attention.decode_attention(query.contiguous(), k_flat, v_flat, group.slots.view(bd, s),
                                                     group.counts, self.scale, self.logits_soft_cap)
        # [Bd * S, Hkv, D] -> [Bd * Hkv, S, D]; a view when Hkv == 1 (Gemma 3 270M, most small models).
        k = k_flat.index_select(0, group.slots).view(bd, s, hkv, d).transpose(1, 2).reshape(bd * hkv, s, d)
        # One query token: the G = Hq / Hkv heads of a KV head are the rows of its product.
        q = query.float().reshape(bd * hkv, hq // hkv, d)
        bias = group.bias if hkv == 1 else group.bias.repeat_interleave(hkv, dim=0)  # [Bd * Hkv, 1, S]
        probs = self._probs(q, k.float(), bias)  # [Bd * Hkv, G, S]
        if v_flat.dtype == torch.float32:
            # sum_s p[b, h, s] * V[slot(b, s)] as a weighted embedding bag: it reads the value rows
            # where they lie in the cache, instead of gathering a [Bd, S, D] copy for a batched product
            # (0.7 ms instead of 1.9 ms a layer at 32 x 300 keys, D = 256). Invisible keys weigh 0.
            rows = group.value_rows_for(hq, hkv)
            out = F.embedding_bag(rows, v_flat.view(-1, d), per_sample_weights=probs.view(bd * hq, s), mode="sum")
            return out.view(bd, hq, d)
        v = v_flat.index_select(0, group.slots).view(bd, s, hkv, d).transpose(1, 2).reshape(bd * hkv, s, d)
        return torch.bmm(probs, v.float()).view(bd, hq, d)

    def _prefill(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]: this step's keys
        value: torch.Tensor,  # [T, Hkv, D]
        k_flat: torch.Tensor,  # [num_slots, Hkv, D]
        v_flat: torch.Tensor,  # [num_slots, Hkv, D]
        chunk: _PrefillChunk,
        out: torch.Tensor,  # [T, Hq, D]; rows start .. end - 1 are written
    ) -> None:
        if chunk.slots is None:
            # No cached prefix: position p is this step's row start + p, rounded as the cache holds it.
            k = to_cache_dtype(key[chunk.start + chunk.first_key : chunk.end], k_flat.dtype)
            v = to_cache_dtype(value[chunk.start + chunk.first_key : chunk.end], v_flat.dtype)
        else:
            k = k_flat.index_select(0, chunk.slots)
            v = v_flat.index_select(0, chunk.slots)
        hq, d = query.shape[1], query.shape[2]
        hkv = self.num_kv_heads
        g = hq // hkv
        k = k.float().transpose(0, 1).contiguous()  # [Hkv, S, D], key j at position first_key + j
        v = v.float().transpose(0, 1).contiguous()
        window = self.sliding_window
        first_query = chunk.seq_len - (chunk.end - chunk.start)
        for t0 in range(chunk.start, chunk.end, _PREFILL_TILE):
            t1 = min(t0 + _PREFILL_TILE, chunk.end)
            rows = t1 - t0
            q_first = first_query + t0 - chunk.start
            # The tile's queries see keys from (first query - window + 1) up to its last query, no further.
            k_first = max(chunk.first_key, q_first - window + 1) if window is not None else chunk.first_key
            k_end = q_first + rows
            kt = k[:, k_first - chunk.first_key : k_end - chunk.first_key]
            vt = v[:, k_first - chunk.first_key : k_end - chunk.first_key]
            num_keys = k_end - k_first
            if self.logits_soft_cap is None:
                # torch's fused CPU attention (flash-style tiles, no [rows, keys] probabilities kept):
                # ~30% faster than the products below at prompt-chunk sizes. A tile whose keys are
                # exactly its own queries, none beyond the window, is plain causal (top-left aligned).
                square = k_first == q_first and num_keys == rows and (window is None or rows <= window)
                mask = None if square else _prefill_bias(q_first, rows, k_first, num_keys, window)
                o = F.scaled_dot_product_attention(
                    query[t0:t1].float().transpose(0, 1).unsqueeze(0),  # [1, Hq, rows, D]
                    kt.unsqueeze(0),  # [1, Hkv, S, D]
                    vt.unsqueeze(0),
                    attn_mask=mask,
                    is_causal=square,
                    scale=self.scale,
                    enable_gqa=g > 1,
                )  # [1, Hq, rows, D]
                out[t0:t1] = o[0].transpose(0, 1).to(out.dtype)
                continue
            # [rows, Hq, D] -> [Hkv, G * rows, D]: a KV head's G query heads stacked as rows.
            q = query[t0:t1].float().view(rows, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * rows, d)
            bias = _prefill_bias(q_first, rows, k_first, num_keys, window)
            if g > 1:
                bias = bias.repeat(g, 1)  # row i * rows + r is head i's row r
            o = torch.bmm(self._probs(q, kt, bias), vt)  # [Hkv, G * rows, D]
            out[t0:t1] = o.view(hkv, g, rows, d).permute(2, 0, 1, 3).reshape(rows, hq, d).to(out.dtype)

    def forward(
        self,
        query: torch.Tensor,  # [T_padded, Hq, D]
        key: torch.Tensor,  # [T_padded, Hkv, D]
        value: torch.Tensor,  # [T_padded, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T_padded, Hq, D]
        md = attn_metadata
        num_tokens = md.num_actual_tokens
        k_flat = kv_cache[0].view(-1, self.num_kv_heads, self.head_size)
        v_flat = kv_cache[1].view(-1, self.num_kv_heads, self.head_size)
        new_k, new_v, slots = key[:num_tokens], value[:num_tokens], md.slot_mapping[:num_tokens]
        if not decode_attention.write_kv_if_usable(new_k, new_v, k_flat, v_flat, slots):
            write_kv_cache(new_k, new_v, kv_cache, slots)
        plan = _step_plan(md, kv_cache.shape[2], self.sliding_window)

        if plan.decode_all and query.shape[0] == num_tokens:
            # A pure-decode step: the batched result is the whole output, no zero fill or scatter.
            return self._decode(query, k_flat, v_flat, plan.decode[self.sliding_window]).to(query.dtype)
        out = torch.zeros_like(query)
        if plan.decode_rows is not None:
            group = plan.decode[self.sliding_window]
            if plan.decode_all:
                out[:num_tokens] = self._decode(query[:num_tokens], k_flat, v_flat, group).to(out.dtype)
            else:
                o = self._decode(query.index_select(0, plan.decode_rows), k_flat, v_flat, group)
                out.index_copy_(0, plan.decode_rows, o.to(out.dtype))
        for chunk in plan.prefill[self.sliding_window]:
            self._prefill(query, key, value, k_flat, v_flat, chunk, out)
        return out


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return CpuAttentionImpl
