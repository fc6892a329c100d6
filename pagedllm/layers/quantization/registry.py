"""The quantization methods by ``quant_method``: each name's config class, imported when a checkpoint names it."""
from __future__ import annotations

import importlib

from pagedllm.config import ONLINE_QUANTIZATION_METHODS as ONLINE_METHODS
from pagedllm.layers.quantization.base import QuantizationConfig

# quant_method -> (module, config class); imported when a checkpoint names it.
_CONFIGS: dict[str, tuple[str, str]] = {
    "awq": ("pagedllm.layers.quantization.awq", "AWQConfig"),
    "gptq": ("pagedllm.layers.quantization.gptq", "GPTQConfig"),
    "compressed-tensors": ("pagedllm.layers.quantization.compressed_tensors", "CompressedTensorsConfig"),
    "fp8": ("pagedllm.layers.quantization.fp8_config", "Fp8Config"),
    "gguf": ("pagedllm.layers.quantization.gguf", "GGUFConfig"),
    "modelopt": ("pagedllm.layers.quantization.modelopt", "ModelOptConfig"),
}


def supported_methods() -> tuple[str, ...]:
    return tuple(sorted(set(_CONFIGS) | set(ONLINE_METHODS)))


def get_config_class(method: str) -> type[QuantizationConfig]:
    if method not in _CONFIGS:
        raise NotImplementedError(
            f"checkpoint quantization {method!r} (quant_method) is not supported; supported: "
            f"{', '.join(sorted(_CONFIGS))} (and {', '.join(ONLINE_METHODS)} with --quantization)"
        )
    module, cls = _CONFIGS[method]
    return getattr(importlib.import_module(module), cls)


def parse_quantization_config(cfg: dict) -> QuantizationConfig:
    """The config for a checkpoint's ``quantization_config`` dict; raises naming the field and value it cannot hold."""
    return get_config_class(str(cfg.get("quant_method"))).from_config(cfg)
