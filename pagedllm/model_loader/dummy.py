"""Random weights for a model built from its config alone: for tests, benchmarks and profiling without a checkpoint."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.model_loader.base import BaseModelLoader, build_checkpoint_model, finalize_model


def initialize_dummy_weights(model: nn.Module, low: float = -1e-3, high: float = 1e-3, seed: int = 0) -> None:
    """Fills every parameter from U(low, high), in registration order, from one seeded generator.

    Values are drawn in float32 and then cast, so one seed gives the same weights in any dtype on
    a given device type. The small range keeps activations far from overflow in half precision.
    Integer tensors (a quantized checkpoint's packed values, zero points, group indices) are set to zero,
    which every format accepts; the products still run their packed kernels, so such a model times
    like the real checkpoint.
    """
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for param in model.parameters():
            if not param.dtype.is_floating_point:
                param.zero_()
                continue
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            values.uniform_(low, high, generator=gen)
            param.copy_(values)


class DummyModelLoader(BaseModelLoader):
    def load_model(
        self, model_config: ModelConfig, device: torch.device, attn_backend: type[AttentionBackend]
    ) -> nn.Module:
        # A config with a quantization_config (an AWQ/GPTQ/W8A8 model's shape) gets that format's linears, so
        # random weights time like the checkpoint.
        model, qconfig = build_checkpoint_model(model_config, device, attn_backend)
        initialize_dummy_weights(model, seed=model_config.seed)
        if qconfig is not None:
            from pagedllm.layers.quantization.base import process_loaded_weights

            process_loaded_weights(model)
        return finalize_model(model, device, model_config.quantization, model_config.cpu_int8_activations)
