"""Attention backends over the paged KV cache, behind one interface (see backend.py)."""
from pagedllm.attention.backend import AttentionBackend, AttentionImpl
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.registry import get_attn_backend

__all__ = ["AttentionBackend", "AttentionImpl", "AttentionMetadata", "get_attn_backend"]
