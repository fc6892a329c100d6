"""How a model copies checkpoint tensors into its parameters: by name, fused shards through each
parameter's ``weight_loader``. Models call it from their ``load_weights``; the loaders in model_loader/
only iterate the tensors."""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


StackedMapping = Sequence[tuple[str, str, int | str]]  # (fused param name, checkpoint name, shard id)
# checkpoint projection of one expert (``gate_proj``, ``w1``) -> (stacked parameter name, shard id)
ExpertMapping = Mapping[str, tuple[str, str]]

# A float8 checkpoint stores each expert projection's scales beside it (``experts.3.gate_proj.weight_scale``); a
# GGUF file's packed experts come as their ggml type and rows (``.qweight_type``, ``.qweight``).
_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.([^.]+)\.(weight|weight_scale|qweight|qweight_type)$")


def _expert_target(name: str, mapping: ExpertMapping) -> tuple[str, str, int] | None:
    """(parameter name, shard id, expert id) of a per-expert checkpoint tensor, or None for any other."""
    m = _EXPERT_TENSOR.search(name) if mapping else None
    if m is None or m.group(2) not in mapping:
        return None
    param_name, shard_id = mapping[m.group(2)]
    param_name = param_name.removesuffix("weight") + m.group(3)  # w13_weight -> w13_weight_scale, w13_qweight, ...
    return f"{name[:m.start()]}.experts.{param_name}", shard_id, int(m.group(1))


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: StackedMapping = (),
    skip_prefixes: Sequence[str] = (),
    skip_substrings: Sequence[str] = (),
    expert_params_mapping: ExpertMapping | None = None,
) -> set[str]:
    """Copies checkpoint tensors into ``model``'s parameters and returns the parameter names filled.

    A checkpoint name whose module component matches a mapping's checkpoint name (``q_proj``) goes
    into the fused parameter (``qkv_proj``) through its ``weight_loader`` with that shard id; any
    other name is loaded as is. Matching is by whole dotted component so ``qkv_proj`` (a fused
    checkpoint such as Phi-3's) is never mistaken for ``v_proj``. One expert's projection
    (``mlp.experts.3.gate_proj.weight``) goes first, through ``expert_params_mapping``, into its slot of
    the stacked parameter (``mlp.experts.w13_weight``), its loader told the shard and the expert id.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            if any(name.startswith(p) for p in skip_prefixes) or any(s in name for s in skip_substrings):
                continue
            expert = _expert_target(name, expert_params_mapping)
            if expert is not None:
                target, shard_id, expert_id = expert
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter {target!r} in "
                                     f"{type(model).__name__}")
                param.weight_loader(param, tensor, shard_id, expert_id)
                # A stacked parameter counts as loaded once its loader has every expert's pieces.
                if param.all_loaded():
                    loaded.add(target)
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
            if getattr(param, "all_loaded", lambda: True)():
                loaded.add(target)
    return loaded
