"""KV-cache scales read from checkpoints that carry them (``*.k_scale``, ``*.v_scale`` or one ``*.kv_scale`` per
attention layer, as llm-compressor writes them for a float8 cache), handed to the attention layers.

A float8 cache then holds ``k / k_scale`` and ``v / v_scale`` instead of the raw values, so that keys and
values beyond float8's range (448 for e4m3) are not clipped. The attention layer applies them around its
backend (``Attention.forward``): since ``q . k = (q * k_scale) . (k / k_scale)`` and the output is linear
in v, every backend computes the scaled attention unchanged. Without a float8 cache the scales are unused.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")
# Module names a checkpoint may put its scales under, below the layer's attention block.
_HOLDERS = (".k_proj", ".v_proj", ".qkv_proj", ".attn")


def collect_kv_scales(weights: Iterable[tuple[str, torch.Tensor]],
                      found: dict[str, dict[str, float]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes every tensor on except KV scales, which go into ``found`` as {attention block: {"k"/"v": scale}}."""
    for name, tensor in weights:
        suffix = next((s for s in KV_SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        block = name[: -len(suffix)]
        for holder in _HOLDERS:
            if block.endswith(holder):
                block = block[: -len(holder)]
                break
        if tensor.numel() != 1:
            raise ValueError(f"checkpoint tensor {name!r} holds {tensor.numel()} values; a KV scale is one value "
                             f"per layer")
        value = float(tensor.float().reshape(()))
        if not value > 0:
            raise ValueError(f"checkpoint tensor {name!r} is {value}; a KV scale must be positive")
        kinds = ("k", "v") if suffix == ".kv_scale" else (suffix[1],)
        for kind in kinds:
            found.setdefault(block, {})[kind] = value


def attach_kv_scales(model: nn.Module, found: dict[str, dict[str, float]]) -> int:
    """Gives each attention layer its checkpoint scales (``checkpoint_kv_scales``); returns how many layers got
    them. A scale whose block holds no attention layer of this model (another pipeline stage's) is dropped."""
    from pagedllm.layers.attention import Attention

    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        scales = found.get(parent) or found.get(name)
        if scales:
            module.checkpoint_kv_scales = (scales.get("k", 1.0), scales.get("v", 1.0))
            count += 1
    return count


def use_kv_scales(model: nn.Module, cache_dtype: torch.dtype) -> None:
    """Turns the checkpoint scales on where the cache is float8 (else the layers keep unit scales)."""
    from pagedllm.layers.attention import Attention

    float8 = cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    for module in model.modules():
        if isinstance(module, Attention):
            ks, vs = getattr(module, "checkpoint_kv_scales", (1.0, 1.0))
            module.k_scale, module.v_scale = (ks, vs) if float8 else (1.0, 1.0)
