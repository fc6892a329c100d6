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

# One expert's projection tensor: ``.weight``; a float8 checkpoint's ``.weight_scale`` beside it; a GGUF file's
# ggml type and rows (``.qweight_type``, ``.qweight``); a packed format's own names (``.qzeros``, ``.scales``,
# ``.weight_packed``, ...), which go to that expert's own linear (``layers/fused_moe/linear_experts.py``).
_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.([^.]+)\.([^.]+)$")


def _expert_target(name: str, mapping: ExpertMapping) -> tuple[str, str, int, str] | None:
    """(stacked parameter name, shard id, expert id, that expert's own parameter name) of a per-expert
    checkpoint tensor, or None for any other."""
    m = _EXPERT_TENSOR.search(name) if mapping else None
    if m is None or m.group(2) not in mapping:
        return None
    param_name, shard_id = mapping[m.group(2)]
    param_name = param_name.removesuffix("weight") + m.group(3)  # w13_weight -> w13_weight_scale, w13_qweight, ...
    prefix = f"{name[:m.start()]}.experts"
    return f"{prefix}.{param_name}", shard_id, int(m.group(1)), f"{prefix}.{m.group(1)}.{shard_id}.{m.group(3)}"


def _load_expert_tensor(model: nn.Module, params: dict, name: str, tensor: torch.Tensor,
                        target: tuple[str, str, int, str]) -> str | None:
    """Loads one expert's tensor into the stacked parameter, or into the expert's own linear; returns the
    parameter name once it is complete, None while not (or for another expert-parallel rank's expert)."""
    stacked, shard_id, expert_id, own = target
    param = params.get(stacked)
    if param is not None:
        param.weight_loader(param, tensor, shard_id, expert_id)
        # A stacked parameter counts as loaded once its loader has every expert's pieces.
        return stacked if param.all_loaded() else None
    param = params.get(own)
    if param is not None:
        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        return own
    try:
        experts = model.get_submodule(own.rsplit(".", 3)[0])  # the MoE layer: ``<prefix>.experts``
    except AttributeError:
        experts = None
    if hasattr(experts, "local_expert") and experts.local_expert(shard_id, expert_id) is None:
        return None  # another expert-parallel rank's expert
    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter {stacked!r} in {type(model).__name__}")


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
    the stacked parameter (``mlp.experts.w13_weight``), its loader told the shard and the expert id, or, for
    experts held as linears, into that expert's own (``mlp.experts.3.w1.weight``).
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            if any(name.startswith(p) for p in skip_prefixes) or any(s in name for s in skip_substrings):
                continue
            expert = _expert_target(name, expert_params_mapping)
            if expert is not None:
                done = _load_expert_tensor(model, params, name, tensor, expert)
                if done is not None:
                    loaded.add(done)
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
