"""The attention layer of a model: reshapes flat projections into heads and hands them to the backend's impl."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """Paged attention of one layer. It owns no weights; the KV cache is passed in on every call."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        attn_backend: type[AttentionBackend],
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.backend = attn_backend
        self.impl = attn_backend.get_impl_cls()(
            num_heads, head_size, scale, num_kv_heads, sliding_window, logits_soft_cap
        )

    def forward(
        self,
        query: torch.Tensor,  # [T, Hq*D]
        key: torch.Tensor,  # [T, Hkv*D]
        value: torch.Tensor,  # [T, Hkv*D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
        rotary=None,  # a RotaryEmbedding still to apply to query and key (only if fuses_decode_rotary)
        kv_written: bool = False,  # the caller stored key and value into kv_cache already (takes_written_kv)
    ) -> torch.Tensor:  # [T, Hq*D]
        num_tokens = query.shape[0]
        extra = {} if rotary is None else {"rotary": rotary}
        if kv_written:
            extra["kv_written"] = True
        out = self.impl.forward(
            query.view(num_tokens, self.num_heads, self.head_size),
            key.view(num_tokens, self.num_kv_heads, self.head_size),
            value.view(num_tokens, self.num_kv_heads, self.head_size),
            kv_cache,
            attn_metadata,
            **extra,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_size)

    def fuses_decode_rotary(self, attn_metadata: AttentionMetadata, rotary) -> bool:
        """Whether the backend rotates q and k itself in this step (forward's ``rotary``)."""
        return self.impl.fuses_decode_rotary(attn_metadata, rotary)

    def takes_written_kv(self, attn_metadata: AttentionMetadata) -> bool:
        """Whether the caller may store this step's K/V into the cache itself and pass ``kv_written``."""
        return self.impl.takes_written_kv(attn_metadata)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"scale={self.scale:.4g}, sliding_window={self.sliding_window}, "
            f"soft_cap={self.logits_soft_cap}, backend={getattr(self.backend, 'name', self.backend.__name__)}"
        )
