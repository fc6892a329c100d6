"""What an attention launch may take besides q and the paged cache, as named tuples: the new keys and values it
stores itself, the step's own key/value rows it reads, and the q/k transforms it or a launch before it applies.

Torch only (no triton), so that the backend interface can describe a layer's modules with these types on
machines without triton.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class NewKV(NamedTuple):
    """A pure-decode step's new keys and values, stored into the cache by the attention launch itself."""

    key: torch.Tensor  # [T, Hkv, D], head channels contiguous
    value: torch.Tensor  # [T, Hkv, D], head channels contiguous
    slot_mapping: torch.Tensor  # [>= T] int64 cache slots; negative for padding tokens, which store nothing


class ChunkKV(NamedTuple):
    """Outside pure decode: the step's keys and values, already in the cache, read from these rows instead."""

    key: torch.Tensor  # [T, Hkv, D] in the cache's dtype
    value: torch.Tensor  # [T, Hkv, D] in the cache's dtype


class Rope(NamedTuple):
    """A neox-style rotary embedding as numbers: channel d < R/2 of a head pairs with d + R/2; channels past R
    pass through. ``freqs = position * inv_freq`` in float32, cos and sin times ``scaling``."""

    inv_freq: torch.Tensor  # [R/2] float32, contiguous, on the activations' device
    scaling: float  # HF's attention_scaling


class QKNorm(NamedTuple):
    """Per-head RMSNorms of q and k as numbers: float32 statistics over D channels, then the weight."""

    q_weight: torch.Tensor  # [D]
    k_weight: torch.Tensor  # [D]
    q_eps: float
    k_eps: float
    # Gemma style: the weight is an offset from 1, applied in float32 before the cast to the activation
    # dtype; else (Llama style) the normalised value is cast first and multiplied in that dtype.
    gemma: bool
