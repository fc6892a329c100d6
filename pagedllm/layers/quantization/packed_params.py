"""How a quantized linear's tensors split: each parameter states which dimension indexes output channels and
which input channels, and how many channels one index covers (a pack factor, a group or block size).

From that statement alone a checkpoint tensor is placed: a fused layer's shard (q/k/v, gate/up) lands at
its offset along the output dimension, a column-parallel rank takes its slice of output channels and a
row-parallel rank its slice of input channels, each in the parameter's own units. A dimension stated as
neither is replicated (a scale shared by all input channels, GPTQ's act-order scales, which every rank
needs whole because its ``g_idx`` names global groups).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class PackedParam:
    name: str
    shape: tuple[int, ...]  # this rank's
    dtype: torch.dtype | None  # None: the model's dtype
    output_dim: int | None = None  # dimension indexing output channels (shards and column-parallel split it)
    output_unit: int = 1  # output channels per index along output_dim (pack factor, block rows)
    input_dim: int | None = None  # dimension indexing input channels (row-parallel splits it)
    input_unit: int = 1  # input channels per index along input_dim (pack factor, group size, block columns)


def _units(channels: int, unit: int, spec: PackedParam, what: str) -> int:
    if channels % unit:
        raise ValueError(f"{spec.name}: {what} of {channels} channels is not a multiple of its {unit}-channel "
                         f"packing/grouping unit")
    return channels // unit


def _checkpoint_shards(layer: nn.Module) -> list[tuple[int | str, int]] | None:
    """(shard id, output channels) of each logical tensor a fused checkpoint tensor holds; None if not fused."""
    if hasattr(layer, "total_num_heads"):
        d = layer.head_size
        return [("q", layer.total_num_heads * d), ("k", layer.total_num_kv_heads * d), ("v", layer.total_num_kv_heads * d)]
    if hasattr(layer, "output_sizes"):
        return list(enumerate(layer.output_sizes))
    return None


def _output_shard(layer: nn.Module, shard_id) -> tuple[int, int, int] | None:
    """(offset in this rank's output channels, channels, rank whose slice of the checkpoint tensor to take), or
    None when the layer does not split its outputs (row-parallel, replicated)."""
    if hasattr(layer, "input_size_per_partition") or not hasattr(layer, "output_size_per_partition"):
        return None
    if shard_id is None:
        return 0, layer.output_size_per_partition, layer.tp_rank
    if shard_id == "q":
        return 0, layer.q_size, layer.tp_rank
    if shard_id in ("k", "v"):
        offset = layer.q_size + (layer.kv_size if shard_id == "v" else 0)
        return offset, layer.kv_size, layer.tp_rank // layer.num_kv_head_replicas
    tp = layer.tp_size
    return sum(layer.output_sizes[:shard_id]) // tp, layer.output_sizes[shard_id] // tp, layer.tp_rank


def load_packed(layer: nn.Module, spec: PackedParam, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Copies a checkpoint tensor (or one shard of a fused layer) into ``param`` as ``spec`` states."""
    # A per-row vector stored as [N] or [N, 1] either way.
    if loaded.dim() == 1 and param.dim() == 2 and param.shape[1] == 1:
        loaded = loaded[:, None]
    elif loaded.dim() == 2 and loaded.shape[1] == 1 and param.dim() == 1:
        loaded = loaded[:, 0]
    shards = _checkpoint_shards(layer)
    if shard_id is None and shards is not None and spec.output_dim is not None:
        units = [_units(n, spec.output_unit, spec, f"shard {sid}") for sid, n in shards]
        for (sid, _), piece in zip(shards, loaded.split(units, dim=spec.output_dim)):
            load_packed(layer, spec, param, piece, sid)
        return
    dst, src = param.data, loaded
    out = _output_shard(layer, shard_id) if spec.output_dim is not None else None
    if out is not None:
        offset, size, rank = out
        n = _units(size, spec.output_unit, spec, f"output shard {shard_id}")
        dst = dst.narrow(spec.output_dim, _units(offset, spec.output_unit, spec, "shard offset"), n)
        src = src.narrow(spec.output_dim, rank * n, n)
    if spec.input_dim is not None and hasattr(layer, "input_size_per_partition") and layer.tp_size > 1:
        k = _units(layer.input_size_per_partition, spec.input_unit, spec, "a rank's input slice")
        src = src.narrow(spec.input_dim, layer.tp_rank * k, k)
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch loading {spec.name} (shard {shard_id}): parameter {tuple(dst.shape)}, "
                         f"checkpoint {tuple(src.shape)}")
    if spec.output_dim is None and shards is not None and shard_id is not None:
        # Shared by every shard (an act-order g_idx of q/k/v): all shards must agree.
        seen = getattr(param, "shard_seen", False)
        if seen and not torch.equal(dst, src.to(dst.device, dst.dtype)):
            raise ValueError(f"{spec.name} differs between the shards fused into one layer (shard {shard_id})")
        param.shard_seen = True
    dst.copy_(src)
