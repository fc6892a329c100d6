"""The attention backend interface: cache layout plus one forward over a mixed, paged batch, given q and k
with the norms and rotary embedding still to apply (``QKTransform``), so that the backend decides what to fuse."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import NamedTuple

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.attention.fused_inputs import QKNorm, Rope


class QKTransform(NamedTuple):
    """What a layer applies to q and k before attention: per-head RMSNorms, then a rotary embedding.

    A model hands its modules over (``Attention.forward``) and never learns what the backend does with them.
    ``apply`` runs the modules; ``rope`` and ``norm`` say the same as numbers, for a backend whose kernels
    apply them. The layer sets those only where they describe exactly what the modules compute
    (``layers.attention.qk_transform``: the exact module classes, neox-style rotary), so that a backend
    may rely on them without knowing the module classes.
    """

    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None  # (positions, q, k) -> (q, k)
    q_norm: Callable[[torch.Tensor], torch.Tensor] | None = None  # [T, Hq, D] -> [T, Hq, D]
    k_norm: Callable[[torch.Tensor], torch.Tensor] | None = None  # [T, Hkv, D] -> [T, Hkv, D]
    rope: Rope | None = None  # ``rotary`` as numbers
    norm: QKNorm | None = None  # ``q_norm`` and ``k_norm`` as numbers

    def apply(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor  # [T], [T, Hq, D], [T, Hkv, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (query, key), same shapes
        """The modules in order, as the model's own forward would run them."""
        if self.q_norm is not None:
            query = self.q_norm(query)
        if self.k_norm is not None:
            key = self.k_norm(key)
        if self.rotary is not None:
            query, key = self.rotary(positions, query, key)
        return query, key


class AttentionImpl(ABC):
    """Attention of one layer. Writes this step's K/V into the paged cache, then attends.

    ``forward`` takes q and k as attention reads them; ``forward_qk`` takes them with the transforms still
    to apply, and is where a backend decides what to fuse.
    """

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

    def forward_qk(
        self,
        positions: torch.Tensor,  # [T] int64
        query: torch.Tensor,  # [T, num_heads, head_size], before qk's norm and rotary embedding
        key: torch.Tensor,  # [T, num_kv_heads, head_size], likewise
        value: torch.Tensor,  # [T, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        attn_metadata: AttentionMetadata,
        qk: QKTransform,
    ) -> torch.Tensor:  # [T, num_heads, head_size]
        """``forward`` of query and key once ``qk`` is applied to them: what a model layer calls.

        Here the modules run as they are, then ``forward``. A backend overrides this to apply them inside
        its own launches (fused with each other, with the cache write or with attention itself) where
        ``qk.rope`` and ``qk.norm`` describe them; the result must be the modules' up to rounding.
        """
        query, key = qk.apply(positions, query, key)
        return self.forward(query, key, value, kv_cache, attn_metadata)


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
