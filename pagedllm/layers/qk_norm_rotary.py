"""The fused q/k RMSNorm + rotary kernel (kernels/qk_norm_rotary.py) applied from a layer's own norm and
rotary modules, with the check that the kernel computes exactly what those modules would."""
from __future__ import annotations

import torch

from pagedllm.kernels import qk_norm_rotary as kernel
from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding


def modules_usable(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, q_norm, k_norm, rotary_emb) -> bool:
    """``usable`` for a layer's ``q_norm``/``k_norm`` (RMSNorm or GemmaRMSNorm, same class) and RotaryEmbedding."""
    # Exact classes: a subclass could change the weight's application and the kernel would not know.
    kind = type(q_norm)
    return (
        kind in (RMSNorm, GemmaRMSNorm)
        and type(k_norm) is kind
        and type(rotary_emb) is RotaryEmbedding
        and q_norm.hidden_size == k_norm.hidden_size == rotary_emb.head_size
        and kernel.usable(
            positions, query, key, q_norm.weight, k_norm.weight, rotary_emb.inv_freq,
            rotary_emb.head_size, rotary_emb.is_neox_style, kind is GemmaRMSNorm,
        )
    )


def apply_(
    positions: torch.Tensor,  # [T] int
    query: torch.Tensor,  # [T, Hq*D] or [T, Hq, D]; rewritten in place
    key: torch.Tensor,  # [T, Hkv*D] or [T, Hkv, D]; rewritten in place
    q_norm,
    k_norm,
    rotary_emb,
    cache: kernel.KVCacheWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (query, key), the same tensors
    """``rotary_emb(positions, q_norm(q), k_norm(k))`` from the layer's modules; check ``modules_usable`` first
    (and ``cache_write_usable`` for ``cache``)."""
    return kernel.qk_norm_rotary_(
        positions, query, key, q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps,
        rotary_emb.inv_freq, rotary_emb.head_size, rotary_emb.attention_scaling,
        gemma=type(q_norm) is GemmaRMSNorm, cache=cache,
    )


# The cache-write arguments, so that a layer needs this module only.
KVCacheWrite = kernel.KVCacheWrite
cache_write_usable = kernel.cache_write_usable
