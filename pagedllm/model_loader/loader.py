"""Builds the model for a config and fills its weights, through a registry of loaders keyed by ``load_format``.

Each loader is imported only when its format is asked for, so a format such as GGUF can be added
as its own module (``pagedllm/model_loader/gguf_loader.py`` with ``GGUFModelLoader``) without
touching this file's logic.
"""
from __future__ import annotations

import importlib

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.config import LoadConfig, ModelConfig
from pagedllm.distributed.parallel_state import get_pp_group, get_tp_group
from pagedllm.layers.kv_scales import attach_kv_scales, collect_kv_scales
from pagedllm.model_loader.base import BaseModelLoader, build_checkpoint_model, check_all_loaded, finalize_model
from pagedllm.model_loader.weight_utils import iterate_weights

# load_format -> (module, loader class)
_LOADERS: dict[str, tuple[str, str]] = {
    "auto": ("pagedllm.model_loader.loader", "DefaultModelLoader"),
    "safetensors": ("pagedllm.model_loader.loader", "DefaultModelLoader"),
    "pt": ("pagedllm.model_loader.loader", "DefaultModelLoader"),
    "dummy": ("pagedllm.model_loader.dummy", "DummyModelLoader"),
    "gguf": ("pagedllm.model_loader.gguf_loader", "GGUFModelLoader"),
}


class DefaultModelLoader(BaseModelLoader):
    """Safetensors (single or sharded) or PyTorch ``*.bin`` checkpoints in ``model_config.model``; a quantized
    checkpoint (``model_loader/quant_config.py``) loads into its method's linears as stored."""

    def load_model(
        self, model_config: ModelConfig, device: torch.device, attn_backend: type[AttentionBackend]
    ) -> nn.Module:
        model, qconfig = build_checkpoint_model(model_config, device, attn_backend)
        # Under tensor parallelism each rank reads only its shard of every tensor, under pipeline parallelism
        # only its stage's tensors.
        sharded = get_tp_group().world_size * get_pp_group().world_size > 1
        weights = iterate_weights(model_config.model, self.load_config.load_format, lazy=sharded)
        # KV-cache scales go to the attention layers, not through the parameter loaders.
        kv_scales: dict[str, dict[str, float]] = {}
        weights = collect_kv_scales(weights, kv_scales)
        if qconfig is not None and qconfig.skip_suffixes():
            skip = qconfig.skip_suffixes()
            weights = ((n, t) for n, t in weights if not n.endswith(skip))
        # Online rotations' matrices (compressed-tensors' transform_config) go around the linears, not into them.
        transforms = None if qconfig is None else qconfig.transforms
        rotations: dict = {}
        if transforms is not None:
            from pagedllm.layers.quantization.transforms import collect_transforms

            weights = collect_transforms(weights, transforms, rotations)
        loaded = model.load_weights(weights)
        check_all_loaded(model, loaded, model_config.model)
        attach_kv_scales(model, kv_scales)
        if qconfig is not None:
            from pagedllm.layers.quantization.base import process_loaded_weights

            process_loaded_weights(model)
        model = finalize_model(model, device, model_config.quantization, model_config.cpu_int8_activations)
        if transforms is not None:
            from pagedllm.layers.quantization.transforms import attach_transforms

            attach_transforms(model, transforms, rotations)
        return model


def available_load_formats() -> list[str]:
    return sorted(_LOADERS)


def get_model_loader(load_config: LoadConfig) -> BaseModelLoader:
    fmt = load_config.load_format
    if fmt not in _LOADERS:
        raise ValueError(f"load_format {fmt!r} is unknown; choose one of {', '.join(available_load_formats())}")
    module, cls = _LOADERS[fmt]
    try:
        loader_cls = getattr(importlib.import_module(module), cls)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise NotImplementedError(f"load_format {fmt!r} is not available in this build ({module} is missing)") from None
    return loader_cls(load_config)


def get_model(
    model_config: ModelConfig,
    load_config: LoadConfig,
    device: torch.device,
    attn_backend: type[AttentionBackend],
) -> nn.Module:
    """The ready-to-run model: eval mode, ``model_config.dtype``, on ``device``."""
    return get_model_loader(load_config).load_model(model_config, torch.device(device), attn_backend)
