"""compressed-tensors checkpoints (``quant_method`` ``compressed-tensors``, llm-compressor's output): one config group
whose scheme says how the linears are stored.

- ``pack-quantized``: 4 or 8-bit integer weights (W4A16, W8A16) packed along the inputs into int32
  ``weight_packed`` [N, K*b/32], offset by 2**(b-1); ``weight_scale`` [N, K/g] (``group``) or [N, 1]
  (``channel``); asymmetric schemes add ``weight_zero_point`` [N*b/32, K/g] packed along the outputs.
- ``int-quantized`` (or ``naive-quantized``): int8 ``weight`` [N, K] per channel, with or without per-token
  dynamic int8 activations (W8A8, ``int8.py``).
- ``float-quantized``: float8 weights per channel or per tensor (``fp8.py``), or per block (``fp8_block.py``).
``weight_shape`` tensors repeat the layer's shape and are not read. A ``transform_config`` (QuIP-style rotations)
adds online rotations around the linears it names (``transforms.py``).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.quantization.base import QuantizationConfig, QuantizedLinearMethod, config_error
from pagedllm.layers.quantization.fp8_config import STATIC_NOTE, UNUSED_SCALE_SUFFIXES
from pagedllm.layers.quantization import wna16_layout
from pagedllm.layers.quantization.packed_params import PackedParam
from pagedllm.layers.quantization.transforms import TransformConfig
from pagedllm.layers.quantization.unpack import ct_pack_dequantize

_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


def _err(field: str, value, supported: str) -> ValueError:
    return config_error("compressed-tensors", field, value, supported)


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, fmt: str, weights: dict, acts: dict | None, ignore: tuple[str, ...]) -> None:
        super().__init__(ignore)
        self.format, self.weights, self.acts = fmt, weights, acts
        # Float8 per channel or per tensor is the engine's fp8 (the same layout as --quantization fp8).
        float8_rows = weights.get("type") == "float" and weights.get("strategy") in ("channel", "tensor")
        self.engine_method = "fp8" if float8_rows else self.name

    @classmethod
    def from_config(cls, cfg: dict) -> CompressedTensorsConfig:
        fmt = cfg.get("format")
        if fmt not in _FORMATS:
            raise _err("format", fmt, ", ".join(_FORMATS))
        groups = list((cfg.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise _err("config_groups", f"{len(groups)} groups", "exactly one group")
        group = groups[0]
        targets = group.get("targets") or []
        if "Linear" not in targets:
            raise _err("targets", targets, "['Linear']")
        weights = group.get("weights") or {}
        acts = group.get("input_activations") or None
        if group.get("output_activations"):
            raise _err("output_activations", group["output_activations"], "none")
        wtype, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
        if weights.get("dynamic"):
            raise _err("weights.dynamic", weights["dynamic"], "false")
        if wtype == "int":
            if bits not in (4, 8):
                raise _err("weights.num_bits", bits, "4, 8")
            if strategy not in ("group", "channel"):
                raise _err("weights.strategy", strategy, "'group', 'channel'")
            if strategy == "group" and not (isinstance(weights.get("group_size"), int) and weights["group_size"] > 0):
                raise _err("weights.group_size", weights.get("group_size"), "a positive number of input channels")
            if weights.get("actorder") not in (None, "static", "weight"):
                raise _err("weights.actorder", weights["actorder"], "none, 'static', 'weight' (no stored g_idx)")
            if fmt == "pack-quantized":
                if acts is not None:
                    raise _err("input_activations", acts, "none with pack-quantized weights (W4A16, W8A16)")
            elif fmt in ("int-quantized", "naive-quantized"):
                if bits != 8 or strategy != "channel":
                    raise _err("weights", f"{bits}-bit {strategy}", "8-bit channel with int-quantized")
            else:
                raise _err("format", fmt, "pack-quantized or int-quantized for integer weights")
            if acts is not None:
                if acts.get("type") != "int" or acts.get("num_bits") != 8:
                    raise _err("input_activations", f"{acts.get('num_bits')}-bit {acts.get('type')}", "8-bit int")
                if acts.get("strategy") != "token" or not acts.get("dynamic"):
                    raise _err("input_activations.strategy", f"{acts.get('strategy')} (dynamic {acts.get('dynamic')})",
                               "'token' with dynamic true")
        elif wtype == "float":
            if bits != 8 or fmt not in ("float-quantized", "naive-quantized"):
                raise _err("weights", f"{bits}-bit float in format {fmt!r}", "8-bit float in float-quantized")
            if strategy not in ("channel", "tensor", "block"):
                raise _err("weights.strategy", strategy, "'channel', 'tensor', 'block'")
            if strategy == "block":
                block = weights.get("block_structure")
                if not (isinstance(block, (list, tuple)) and len(block) == 2):
                    raise _err("weights.block_structure", block, "[rows, columns]")
                if acts is not None and not (acts.get("dynamic") and acts.get("strategy") == "group"):
                    raise _err("input_activations", acts, "dynamic float8 per group of input channels, or none")
        else:
            raise _err("weights.type", wtype, "'int', 'float'")
        config = cls(fmt, weights, acts, tuple(cfg.get("ignore") or ()))
        config.transforms = TransformConfig.from_config(cfg.get("transform_config"))
        if wtype == "float" and strategy != "block" and acts is not None and not acts.get("dynamic", False):
            config.notes.append(STATIC_NOTE)
        return config

    def linear_method(self):
        w, acts = self.weights, self.acts
        if w["type"] == "float":
            if w["strategy"] == "block":
                from pagedllm.layers.quantization.fp8_block import Fp8BlockLinearMethod

                group = None if acts is None else acts.get("group_size")
                return Fp8BlockLinearMethod(tuple(w["block_structure"]), "weight_scale", group)
            from pagedllm.layers.quantization.fp8 import Fp8LinearMethod

            return Fp8LinearMethod(serialized=True)
        symmetric = w.get("symmetric", True)
        if self.format == "pack-quantized":
            group = w.get("group_size") if w["strategy"] == "group" else None
            return PackedWeightOnlyLinearMethod(w["num_bits"], group, symmetric)
        from pagedllm.layers.quantization.int8 import W8A8Int8LinearMethod

        act = None if acts is None else ("symmetric" if acts.get("symmetric", True) else "asymmetric")
        return W8A8Int8LinearMethod(act, symmetric)

    def skip_suffixes(self) -> tuple[str, ...]:
        return (".weight_shape",) + UNUSED_SCALE_SUFFIXES


class PackedWeightOnlyLinearMethod(QuantizedLinearMethod):
    """``pack-quantized`` weights (W4A16, W8A16); ``group_size`` None: one scale per output row."""

    experts_as_linears = True

    def __init__(self, bits: int, group_size: int | None, symmetric: bool) -> None:
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        self.pack = 32 // bits

    def packed_params(self, input_size: int, output_size: int, full_input_size: int) -> list[PackedParam]:
        p = self.pack
        g = input_size if self.group_size is None else self.group_size
        if input_size % g or input_size % p:
            raise ValueError(f"compressed-tensors: a linear of {input_size} inputs does not hold groups of {g} inputs "
                             f"and {p}-value words")
        grouped_dim = None if self.group_size is None else 1
        params = [
            PackedParam("weight_packed", (output_size, input_size // p), torch.int32, 0, 1, 1, p),
            PackedParam("weight_scale", (output_size, input_size // g), None, 0, 1, grouped_dim, g),
        ]
        if not self.symmetric:
            if output_size % p:
                raise ValueError(f"compressed-tensors: {output_size} outputs do not fill {p}-value zero-point words")
            params.append(PackedParam("weight_zero_point", (output_size // p, input_size // g), torch.int32, 0, p,
                                      grouped_dim, g))
        return params

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # On CUDA the weight moves to the common packed layout the Triton kernel reads.
        if wna16_layout.use_kernel(layer):
            self.to_kernel_layout(layer)

    def to_kernel_layout(self, layer: nn.Module) -> None:
        zp = None if self.symmetric else layer.weight_zero_point
        w = wna16_layout.from_compressed_tensors(layer.weight_packed, layer.weight_scale, zp, self.bits,
                                                 self.group_size)
        names = ("weight_packed", "weight_scale") + (() if self.symmetric else ("weight_zero_point",))
        wna16_layout.attach(layer, w, names)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:  # [N, K]
        if hasattr(layer, "wna16"):
            return layer.wna16.dequantize()
        k = layer.weight_packed.shape[1] * self.pack
        g = k if self.group_size is None else self.group_size
        zp = None if self.symmetric else layer.weight_zero_point
        return ct_pack_dequantize(layer.weight_packed, layer.weight_scale, zp, self.bits, g)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [T, K] -> [T, N]
        if hasattr(layer, "wna16"):
            return wna16_layout.apply(layer, x, bias)
        return super().apply(layer, x, bias)
