"""Gated activations of the MLPs: act(gate) * up over a fused [gate | up] input.

``quantize_output`` (set when a float8 or int8 linear consumes the output) makes the CUDA kernel hand the rows
over as ``QuantizedRows`` wherever that linear would quantize them, quantized as it would.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _kernel_act_and_mul(module: nn.Module, x: torch.Tensor, act: str):
    """The Triton kernel's [T, F] result (or QuantizedRows), or None where it does not apply."""
    from pagedllm.kernels import activation as kernel  # one launch instead of two
    from pagedllm.layers.quantization.fused_rows import producer_quantization

    if not kernel.usable(x):
        return None
    return kernel.act_and_mul(x, act, quantize=producer_quantization(module, x))


class SiluAndMul(nn.Module):
    quantize_output: str | None = None  # the consumer's kind of rows (row_quant.KINDS); fused_rows.flag_producers
    quantize_for: tuple[int, int] | None = None  # the consumer's weight shape (outputs, inputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2F] -> [T, F]
        if x.is_cuda and (out := _kernel_act_and_mul(self, x, "silu")) is not None:
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place on the fresh activation: one [T, F] buffer, not two


class GeluAndMul(nn.Module):
    """GELU-gated unit; ``approximate="tanh"`` is HF's ``gelu_pytorch_tanh`` (Gemma)."""

    quantize_output: str | None = None  # the consumer's kind of rows (row_quant.KINDS); fused_rows.flag_producers
    quantize_for: tuple[int, int] | None = None  # the consumer's weight shape (outputs, inputs)

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2F] -> [T, F]
        act = "gelu_tanh" if self.approximate == "tanh" else "gelu"
        if x.is_cuda and (out := _kernel_act_and_mul(self, x, act)) is not None:
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate).mul_(up)  # in place: one [T, F] buffer, not two

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation for an HF ``hidden_act`` / ``hidden_activation`` name."""
    if hidden_act in ("silu", "swish"):
        return SiluAndMul()
    if hidden_act in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"):
        return GeluAndMul("tanh")
    if hidden_act == "gelu":
        return GeluAndMul("none")
    raise ValueError(f"unsupported gated activation {hidden_act!r}; supported: silu, gelu, gelu_pytorch_tanh")
