"""AWQ checkpoints (``quant_method`` ``awq``, AutoAWQ's GEMM layout): 4-bit weights with a zero point and a scale
per group of input channels.

Per linear of N outputs and K inputs, group size g: ``qweight`` [K, N/8] and ``qzeros`` [K/g, N/8] int32, eight
4-bit values a word packed along the outputs in AWQ's interleaved order, and ``scales`` [K/g, N];
``w[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n]``. Column-parallel ranks split the packed output
dimension (by words of 8 channels), row-parallel ranks the input rows (by groups).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.quantization.base import QuantizationConfig, QuantizedLinearMethod, config_error
from pagedllm.layers.quantization import wna16_layout
from pagedllm.layers.quantization.packed_params import PackedParam
from pagedllm.layers.quantization.unpack import awq_dequantize

_PACK = 8  # 4-bit values a word


class AWQConfig(QuantizationConfig):
    name = engine_method = "awq"

    def __init__(self, group_size: int, ignore: tuple[str, ...] = ()) -> None:
        super().__init__(ignore)
        self.group_size = group_size

    @classmethod
    def from_config(cls, cfg: dict) -> AWQConfig:
        bits = cfg.get("bits", cfg.get("w_bit"))
        if bits != 4:
            raise config_error("awq", "bits", bits, "4")
        group = cfg.get("group_size", cfg.get("q_group_size"))
        if not isinstance(group, int) or group <= 0:
            raise config_error("awq", "group_size", group, "a positive number of input channels (64, 128)")
        if not cfg.get("zero_point", True):
            raise config_error("awq", "zero_point", cfg.get("zero_point"), "true")
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise config_error("awq", "version", cfg.get("version"), "'gemm'")
        return cls(group, tuple(cfg.get("modules_to_not_convert") or ()))

    def ignores(self, module_name: str) -> bool:
        # AutoAWQ skips a module when any listed name occurs in its own.
        return any(entry in module_name for entry in self.ignore)

    def linear_method(self) -> AWQLinearMethod:
        return AWQLinearMethod(self.group_size)


class AWQLinearMethod(QuantizedLinearMethod):
    experts_as_linears = True

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def packed_params(self, input_size: int, output_size: int, full_input_size: int) -> list[PackedParam]:
        g = self.group_size
        if input_size % g or output_size % _PACK:
            raise ValueError(f"awq: a linear of {input_size} inputs and {output_size} outputs does not hold groups of "
                             f"{g} inputs and words of {_PACK} outputs")
        return [
            PackedParam("qweight", (input_size, output_size // _PACK), torch.int32, 1, _PACK, 0, 1),
            PackedParam("qzeros", (input_size // g, output_size // _PACK), torch.int32, 1, _PACK, 0, g),
            PackedParam("scales", (input_size // g, output_size), None, 1, 1, 0, g),
        ]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # On CUDA the weight moves to the common packed layout the Triton kernel reads.
        if wna16_layout.use_kernel(layer):
            self.to_kernel_layout(layer)

    def to_kernel_layout(self, layer: nn.Module) -> None:
        w = wna16_layout.from_awq(layer.qweight, layer.qzeros, layer.scales, self.group_size)
        wna16_layout.attach(layer, w, ("qweight", "qzeros", "scales"))

    def dequantize(self, layer: nn.Module) -> torch.Tensor:  # [N, K]
        if hasattr(layer, "wna16"):
            return layer.wna16.dequantize()
        return awq_dequantize(layer.qweight, layer.qzeros, layer.scales, self.group_size)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [T, K] -> [T, N]
        if hasattr(layer, "wna16"):
            return wna16_layout.apply(layer, x, bias)
        return super().apply(layer, x, bias)
