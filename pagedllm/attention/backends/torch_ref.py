"""The reference attention backend: plain torch over the paged cache; the CPU path and every kernel's oracle."""
from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend, AttentionImpl
from pagedllm.attention.metadata import AttentionMetadata

# Decode requests are batched in groups this large so the gathered K/V stays a bounded size.
_DECODE_GROUP = 64


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the cache's element type. Float8 saturates at its largest finite value (as the kernels'
    conversion does) instead of overflowing to inf or NaN."""
    if dtype.itemsize == 1 and x.dtype != dtype:
        fmax = torch.finfo(dtype).max
        x = x.float().clamp(-fmax, fmax)
    return x.to(dtype)


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; negative slots (padding) are skipped
) -> None:
    num_kv_heads, head_size = kv_cache.shape[-2:]
    flat_k = kv_cache[0].view(-1, num_kv_heads, head_size)
    flat_v = kv_cache[1].view(-1, num_kv_heads, head_size)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    key, value = to_cache_dtype(key, kv_cache.dtype), to_cache_dtype(value, kv_cache.dtype)
    if kv_cache.dtype.itemsize == 1:
        # torch has no index_copy for float8 on the CPU; bytes copy the same.
        flat_k, flat_v, key, value = (t.view(torch.uint8) for t in (flat_k, flat_v, key, value))
    flat_k.index_copy_(0, slot_mapping, key)
    flat_v.index_copy_(0, slot_mapping, value)


def gather_kv(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_ids: torch.Tensor,  # [..., nblk] int
) -> tuple[torch.Tensor, torch.Tensor]:  # each [..., nblk * block_size, Hkv, D]
    k = kv_cache[0][block_ids.long()]
    v = kv_cache[1][block_ids.long()]
    if kv_cache.dtype.itemsize == 1:
        # Float8 values widen exactly; torch lacks most float8 operators (masked_fill, einsum).
        k, v = k.float(), v.float()
    shape = (*block_ids.shape[:-1], -1, *kv_cache.shape[-2:])
    return k.reshape(shape), v.reshape(shape)


def attend(
    q: torch.Tensor,  # [..., Lq, Hq, D]
    k: torch.Tensor,  # [..., S, Hkv, D]
    v: torch.Tensor,  # [..., S, Hkv, D]
    allowed: torch.Tensor,  # [..., Lq, S] bool
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:  # [..., Lq, Hq, D] float32
    """Softmax attention in float32 with grouped KV heads."""
    hq, hkv = q.shape[-2], k.shape[-2]
    group = hq // hkv
    qf = q.float().unflatten(-2, (hkv, group))  # [..., Lq, Hkv, G, D]
    scores = torch.einsum("...qhgd,...shd->...hgqs", qf, k.float()) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    mask = allowed.unsqueeze(-3).unsqueeze(-3)  # [..., 1, 1, Lq, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("...hgqs,...shd->...qhgd", probs, v.float())
    return out.flatten(-3, -2)


class TorchRefImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, Hq, D]
        md = attn_metadata
        num_tokens = md.num_actual_tokens
        write_kv_cache(key[:num_tokens], value[:num_tokens], kv_cache, md.slot_mapping[:num_tokens])
        block_size = kv_cache.shape[2]
        out = torch.zeros_like(query)
        qsl, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
        decode_reqs = [i for i in range(md.num_reqs) if qsl[i + 1] - qsl[i] == 1]
        prefill_reqs = [i for i in range(md.num_reqs) if qsl[i + 1] - qsl[i] > 1]

        for g in range(0, len(decode_reqs), _DECODE_GROUP):
            reqs = decode_reqs[g : g + _DECODE_GROUP]
            lens = torch.tensor([seq_lens[i] for i in reqs])
            nblk = (int(lens.max()) + block_size - 1) // block_size
            k, v = gather_kv(kv_cache, md.block_table[reqs, :nblk].cpu().to(kv_cache.device))
            key_pos = torch.arange(nblk * block_size)
            allowed = key_pos[None, :] < lens[:, None]  # [b, S]
            if self.sliding_window is not None:
                allowed &= key_pos[None, :] > (lens[:, None] - 1 - self.sliding_window)
            # Past each request's end lie other requests' or never-written slots (maybe NaN):
            # 0 * NaN would leak through the probabilities, so zero them outright.
            v = v.masked_fill(~allowed.to(v.device)[:, :, None, None], 0.0)
            tok = torch.tensor([qsl[i] for i in reqs], device=query.device)
            q = query[tok].unsqueeze(1)  # [b, 1, Hq, D]
            o = attend(q, k, v, allowed.unsqueeze(1).to(query.device), self.scale, self.logits_soft_cap)
            out[tok] = o.squeeze(1).to(out.dtype)

        for i in prefill_reqs:
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            q_len = end - start
            nblk = (seq_len + block_size - 1) // block_size
            k, v = gather_kv(kv_cache, md.block_table[i, :nblk].to(kv_cache.device))
            k, v = k[:seq_len], v[:seq_len]
            q_pos = torch.arange(seq_len - q_len, seq_len)
            key_pos = torch.arange(seq_len)
            allowed = key_pos[None, :] <= q_pos[:, None]
            if self.sliding_window is not None:
                allowed &= key_pos[None, :] > (q_pos[:, None] - self.sliding_window)
            o = attend(query[start:end], k, v, allowed.to(query.device), self.scale, self.logits_soft_cap)
            out[start:end] = o.to(out.dtype)
        return out


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchRefImpl
