"""What every model loader shares: the loader interface, building a model with unallocated weights, and
finishing it (device, eval mode, quantization) once its weights are in."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.config import LoadConfig, ModelConfig
from pagedllm.models.registry import resolve_model_class

if TYPE_CHECKING:
    from pagedllm.layers.quantization.base import QuantizationConfig


class BaseModelLoader(ABC):
    def __init__(self, load_config: LoadConfig) -> None:
        self.load_config = load_config

    @abstractmethod
    def load_model(
        self, model_config: ModelConfig, device: torch.device, attn_backend: type[AttentionBackend]
    ) -> nn.Module:
        """The model in eval mode, in ``model_config.dtype``, on ``device``, with its weights."""


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    model_config: ModelConfig, device: torch.device | str, attn_backend: type[AttentionBackend]
) -> nn.Module:
    """The model for ``model_config.hf_config`` with uninitialized parameters allocated on ``device``."""
    model_cls = resolve_model_class(model_config.hf_config)
    with _default_dtype(model_config.dtype), torch.device(device):
        return model_cls(model_config, attn_backend)


def build_checkpoint_model(
    model_config: ModelConfig, device: torch.device | str, attn_backend: type[AttentionBackend]
) -> tuple[nn.Module, QuantizationConfig | None]:
    """(model, quantization config): the model built with the linears its checkpoint's ``quantization_config``
    declares (``model_loader/quant_config.py``; None and plain linears for an unquantized checkpoint)."""
    from pagedllm.model_loader.quant_config import checkpoint_quant_config

    qconfig = checkpoint_quant_config(model_config.hf_config)
    if qconfig is None:
        return build_model(model_config, device, attn_backend), None
    from pagedllm.layers.linear import default_linear_method
    from pagedllm.layers.quantization.base import keep_ignored_unquantized

    with default_linear_method(qconfig.linear_method):
        model = build_model(model_config, device, attn_backend)
    keep_ignored_unquantized(model, qconfig.ignores)
    return model, qconfig


def finalize_model(
    model: nn.Module, device: torch.device | str, quantization: str | None = None, int8_activations: bool = False
) -> nn.Module:
    """The loaded model on ``device`` in eval mode, its linears quantized when ``quantization`` names a method
    (``int8_activations``: int4's CPU products take 8-bit activations), and the kernels that produce a float8 or
    int8 linear's input flagged to quantize it themselves."""
    from pagedllm.layers.quantization.fused_rows import flag_producers

    model.requires_grad_(False)
    model = model.to(device).eval()
    if quantization is not None:
        from pagedllm.layers.quantization import quantize_model

        quantize_model(model, quantization, int8_activations)
    flag_producers(model)
    return model


def check_all_loaded(model: nn.Module, loaded: set[str], source: str) -> None:
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {source} lacks {len(missing)} parameters of {type(model).__name__}: {shown}")
