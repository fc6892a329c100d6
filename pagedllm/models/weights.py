"""How a model copies checkpoint tensors into its parameters: by name, fused shards through each
parameter's ``weight_loader``. Models call it from their ``load_weights``; the loaders in model_loader/
only iterate the tensors."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


StackedMapping = Sequence[tuple[str, str, int | str]]  # (fused param name, checkpoint name, shard id)


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: StackedMapping = (),
    skip_prefixes: Sequence[str] = (),
    skip_substrings: Sequence[str] = (),
) -> set[str]:
    """Copies checkpoint tensors into ``model``'s parameters and returns the parameter names filled.

    A checkpoint name whose module component matches a mapping's checkpoint name (``q_proj``) goes
    into the fused parameter (``qkv_proj``) through its ``weight_loader`` with that shard id; any
    other name is loaded as is. Matching is by whole dotted component so ``qkv_proj`` (a fused
    checkpoint such as Phi-3's) is never mistaken for ``v_proj``.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            if any(name.startswith(p) for p in skip_prefixes) or any(s in name for s in skip_substrings):
                continue
            target, shard_id = name, None
            for param_name, ckpt_name, sid in stacked_params_mapping:
                if f".{ckpt_name}." in f".{name}":
                    target, shard_id = f".{name}".replace(f".{ckpt_name}.", f".{param_name}.", 1)[1:], sid
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no matching parameter {target!r} in {type(model).__name__}"
                )
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
            loaded.add(target)
    return loaded
