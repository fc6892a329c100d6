"""NVIDIA TensorRT Model Optimizer checkpoints (``quant_method`` ``modelopt``): float8 e4m3 ``weight`` tensors with
one ``weight_scale`` per tensor and a static ``input_scale`` per linear (``quant_algo`` ``FP8``, as NVIDIA's ``*-FP8``
models on the hub store them), or one scale per output channel and none for the inputs
(``FP8_PER_CHANNEL_PER_TOKEN``).

The weights load into the float8 linears of ``fp8.py`` (each fused shard keeps its own scales); activations are
quantized per token at run time, as for the other float8 checkpoints, so static input scales go unused.
KV-cache scales (``k_scale``/``v_scale``, with ``kv_cache_quant_algo`` FP8) are read by ``layers/kv_scales.py``.
Older exports keep this config only in ``hf_quant_config.json`` (``model_loader/model_source.py`` reads it).
"""
from __future__ import annotations

import fnmatch

from pagedllm.layers.quantization.base import QuantizationConfig, config_error
from pagedllm.layers.quantization.fp8_config import STATIC_NOTE, UNUSED_SCALE_SUFFIXES


# quant_algo values whose weights fp8.py's linears hold: a float8 tensor with one scale, or one a row.
ALGORITHMS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")


class ModelOptConfig(QuantizationConfig):
    name = "modelopt"
    engine_method = "fp8"

    @classmethod
    def from_config(cls, cfg: dict) -> ModelOptConfig:
        algo = cfg.get("quant_algo")
        if algo not in ALGORITHMS:
            raise config_error("modelopt", "quant_algo", algo, ", ".join(map(repr, ALGORITHMS)))
        kv_algo = cfg.get("kv_cache_quant_algo")
        if kv_algo not in (None, "FP8"):
            raise config_error("modelopt", "kv_cache_quant_algo", kv_algo, "null, 'FP8'")
        config = cls(tuple(cfg.get("exclude_modules") or cfg.get("ignore") or ()))
        if algo == "FP8":
            config.notes.append(STATIC_NOTE)
        return config

    def ignores(self, module_name: str) -> bool:
        # Model Optimizer names excluded modules exactly, by a parent, or by a pattern with '*'.
        return any(module_name == entry or module_name.startswith(entry + ".") or fnmatch.fnmatchcase(module_name, entry)
                   for entry in self.ignore)

    def linear_method(self):
        from pagedllm.layers.quantization.fp8 import Fp8LinearMethod

        return Fp8LinearMethod(serialized=True)

    def skip_suffixes(self) -> tuple[str, ...]:
        return UNUSED_SCALE_SUFFIXES
