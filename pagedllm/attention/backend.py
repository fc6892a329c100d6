"""The attention backend interface: cache layout plus one forward over a mixed, paged batch."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedllm.attention.metadata import AttentionMetadata


class AttentionImpl(ABC):
    """Attention of one layer. Writes this step's K/V into the paged cache, then attends."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads (GQA)"
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        # A token at position p sees keys at positions > p - sliding_window (HF's convention).
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_size]
        key: torch.Tensor,  # [T, num_kv_heads, head_size]
        value: torch.Tensor,  # [T, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_size]
        ...

    def fuses_decode_rotary(self, attn_metadata: AttentionMetadata, rotary) -> bool:
        """Whether ``forward(..., rotary=rotary)`` may receive q and k unrotated for this step.

        ``rotary`` is a RotaryEmbedding (inv_freq, attention_scaling, is_neox_style). A backend that says
        yes rotates them itself, at each request's last position; the default backend never does.
        """
        return False

    def takes_written_kv(self, attn_metadata: AttentionMetadata) -> bool:
        """Whether ``forward(..., kv_written=True)`` may be called: the caller has already stored this step's
        keys and values into the cache at ``slot_mapping`` (the cache layout of ``get_kv_cache_shape``), so
        the backend only attends."""
        return False


class AttentionBackend(ABC):
    name: str

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]:
        ...

    @staticmethod
    def workspace_bytes(max_reqs: int, num_heads: int, num_kv_heads: int, head_size: int, cache_bytes: int) -> int:
        """Device scratch the backend's launches keep for a batch of ``max_reqs`` requests, at most: memory
        the KV cache must leave free (``cache_bytes``: bytes per cache element)."""
        return 0

    @staticmethod
    def reserve_workspace(device: torch.device, max_reqs: int, num_heads: int, num_kv_heads: int, head_size: int,
                          cache_bytes: int) -> None:
        """Allocates that scratch now, at its largest, before any CUDA graph is captured."""
