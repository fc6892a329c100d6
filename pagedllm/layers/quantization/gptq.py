"""GPTQ checkpoints (``quant_method`` ``gptq``): 2, 4 or 8-bit weights with a scale and zero point per group of
input channels, groups in input order or, with act-order (``desc_act``), by ``g_idx``.

Per linear of N outputs, K inputs, b bits, G groups (one when ``group_size`` is -1): ``qweight`` [K*b/32, N]
int32 packed along the inputs, ``qzeros`` [G, N*b/32] int32 packed along the outputs, ``scales`` [G, N],
``g_idx`` [K] (each input's group); ``w[n, k] = (q[k, n] - z[g, n]) * s[g, n]`` with ``g = g_idx[k]``.
The original format (``checkpoint_format`` ``gptq``) stores each zero point minus one, ``gptq_v2`` as is.
Row-parallel ranks split ``qweight`` and ``g_idx`` by input rows; they split scales and zeros by groups
too, except under act-order, where ``g_idx`` names groups of the whole input and every rank keeps them all.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from pagedllm.layers.quantization.base import QuantizationConfig, QuantizedLinearMethod, config_error
from pagedllm.layers.quantization import wna16_layout
from pagedllm.layers.quantization.packed_params import PackedParam
from pagedllm.layers.quantization.unpack import gptq_dequantize


def _dynamic_exclusions(dynamic: dict, cfg: dict) -> tuple[str, ...]:
    """GPTQModel's per-module rules (``dynamic``: {pattern: overrides}): the patterns of its "-:" rules, the modules
    kept unquantized. A "+:" (or unprefixed) rule may only restate the checkpoint's own settings: one linear method
    holds every quantized module."""
    if not isinstance(dynamic, dict):
        raise config_error("gptq", "dynamic", dynamic, "a mapping of module patterns to settings")
    skipped = []
    for pattern, overrides in dynamic.items():
        if pattern.startswith("-:"):
            skipped.append(pattern[2:])
            continue
        changed = {k: v for k, v in (overrides if isinstance(overrides, dict) else {}).items() if cfg.get(k) != v}
        if changed or not isinstance(overrides, (dict, bool)):
            raise config_error("gptq", f"dynamic[{pattern!r}]", overrides,
                               "'-:' rules (modules left unquantized) or rules that repeat the checkpoint's settings")
    return tuple(skipped)


class GPTQConfig(QuantizationConfig):
    name = engine_method = "gptq"
    skipped: tuple[str, ...] = ()  # regular expressions of modules the checkpoint keeps unquantized

    def __init__(self, bits: int, group_size: int, desc_act: bool, zero_offset: int, ignore=()) -> None:
        super().__init__(ignore)
        self.bits, self.group_size, self.desc_act, self.zero_offset = bits, group_size, desc_act, zero_offset

    @classmethod
    def from_config(cls, cfg: dict) -> GPTQConfig:
        bits = cfg.get("bits")
        if bits not in (2, 4, 8):
            raise config_error("gptq", "bits", bits, "2, 4, 8")
        group = cfg.get("group_size", -1)
        if not isinstance(group, int) or not (group == -1 or group > 0):
            raise config_error("gptq", "group_size", group, "-1 (one group) or a positive number of input channels")
        desc_act = cfg.get("desc_act", False)
        if not isinstance(desc_act, bool):
            raise config_error("gptq", "desc_act", desc_act, "true, false")
        fmt = cfg.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise config_error("gptq", "checkpoint_format", fmt, "'gptq', 'gptq_v2'")
        if cfg.get("lm_head"):
            raise config_error("gptq", "lm_head", True, "false (the LM head unquantized)")
        config = cls(bits, group, desc_act, 1 if fmt == "gptq" else 0, tuple(cfg.get("modules_to_not_convert") or ()))
        config.skipped = _dynamic_exclusions(cfg.get("dynamic") or {}, cfg)
        return config

    def ignores(self, module_name: str) -> bool:
        # GPTQModel's "-:" rules leave the modules their pattern matches (from the name's start) unquantized.
        return super().ignores(module_name) or any(re.match(p, module_name) for p in self.skipped)

    def linear_method(self) -> GPTQLinearMethod:
        return GPTQLinearMethod(self.bits, self.group_size, self.desc_act, self.zero_offset)

    def skip_suffixes(self) -> tuple[str, ...]:
        # Without act-order g_idx is k // group_size; its tensor, when stored, is not read.
        return () if self.desc_act else (".g_idx",)


class GPTQLinearMethod(QuantizedLinearMethod):
    experts_as_linears = True

    def __init__(self, bits: int, group_size: int, desc_act: bool, zero_offset: int) -> None:
        self.bits, self.group_size, self.desc_act, self.zero_offset = bits, group_size, desc_act, zero_offset
        self.pack = 32 // bits

    def packed_params(self, input_size: int, output_size: int, full_input_size: int) -> list[PackedParam]:
        p = self.pack
        g = full_input_size if self.group_size == -1 else self.group_size
        if (self.group_size != -1 and input_size % g) or input_size % p or output_size % p:
            raise ValueError(f"gptq: a linear of {input_size} inputs and {output_size} outputs does not hold groups "
                             f"of {g} inputs and {p}-value words")
        # One group, or act-order's global group ids: scales and zeros are not split by input, every rank holds
        # those of the whole input.
        replicated = self.group_size == -1 or self.desc_act
        n_groups = (full_input_size if replicated else input_size) // g
        grouped_dim = None if replicated else 0
        params = [
            PackedParam("qweight", (input_size // p, output_size), torch.int32, 1, 1, 0, p),
            PackedParam("qzeros", (n_groups, output_size // p), torch.int32, 1, p, grouped_dim, g),
            PackedParam("scales", (n_groups, output_size), None, 1, 1, grouped_dim, g),
        ]
        if self.desc_act:
            params.append(PackedParam("g_idx", (input_size,), torch.int32, None, 1, 0, 1))
        return params

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.desc_act:
            n_groups = layer.scales.shape[0]
            g = layer.g_idx
            if g.numel() and (int(g.min()) < 0 or int(g.max()) >= n_groups):
                raise ValueError(f"gptq: g_idx holds groups {int(g.min())}..{int(g.max())}, outside the "
                                 f"{n_groups} groups of its scales")
        else:
            k = layer.qweight.shape[0] * self.pack
            g = k if self.group_size == -1 else self.group_size
            layer.register_buffer("g_idx", torch.arange(k, dtype=torch.int32, device=layer.qweight.device) // g,
                                  persistent=False)
        # On CUDA the weight moves to the common packed layout the Triton kernel reads (act-order rows permuted).
        if wna16_layout.use_kernel(layer):
            self.to_kernel_layout(layer)

    def to_kernel_layout(self, layer: nn.Module) -> None:
        w = wna16_layout.from_gptq(layer.qweight, layer.qzeros, layer.scales, layer.g_idx if self.desc_act else None,
                                   self.bits, self.group_size, self.zero_offset)
        wna16_layout.attach(layer, w, ("qweight", "qzeros", "scales", "g_idx"))

    def dequantize(self, layer: nn.Module) -> torch.Tensor:  # [N, K]
        if hasattr(layer, "wna16"):
            return layer.wna16.dequantize()
        return gptq_dequantize(layer.qweight, layer.qzeros, layer.scales, layer.g_idx, self.bits, self.zero_offset)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [T, K] -> [T, N]
        if hasattr(layer, "wna16"):
            return wna16_layout.apply(layer, x, bias)
        return super().apply(layer, x, bias)
