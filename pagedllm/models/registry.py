"""Maps HF architecture names (``config.architectures``) to model classes, each module imported only when asked for."""
from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# architecture -> (module under pagedllm.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "LLaMAForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(arch: str) -> type[nn.Module]:
    if arch not in _MODELS:
        raise ValueError(
            f"model architecture {arch!r} is not supported; supported architectures: "
            f"{', '.join(supported_architectures())}"
        )
    module, cls = _MODELS[arch]
    return getattr(importlib.import_module(f"pagedllm.models.{module}"), cls)


def resolve_model_class(hf_config: Any) -> type[nn.Module]:
    """The class for the first supported entry of ``hf_config.architectures``."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            return get_model_class(arch)
    raise ValueError(
        f"none of the model's architectures {archs} is supported; supported architectures: "
        f"{', '.join(supported_architectures())}"
    )
