"""vLLM's own ``fp8`` checkpoint layout (AutoFP8, DeepSeek/Qwen3-FP8): float8 e4m3 ``weight`` tensors with one
scale per tensor (``weight_scale``), or per block with ``weight_block_size`` (``weight_scale_inv``)."""
from __future__ import annotations

from pagedllm.layers.quantization.base import QuantizationConfig, config_error

# Checkpoint tensors of these suffixes hold scales the float8 linears do not use (activations are always
# quantized per token at run time). KV-cache scales are read by the loader (``layers/kv_scales.py``).
UNUSED_SCALE_SUFFIXES = (".input_scale", ".output_scale")
STATIC_NOTE = ("checkpoint has static activation scales; pagedllm quantizes activations per token at run time "
               "instead and leaves the input_scale tensors unused")


class Fp8Config(QuantizationConfig):
    name = engine_method = "fp8"

    def __init__(self, block: tuple[int, int] | None, ignore: tuple[str, ...] = ()) -> None:
        super().__init__(ignore)
        self.block = block

    @classmethod
    def from_config(cls, cfg: dict) -> Fp8Config:
        scheme = cfg.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise config_error("fp8", "activation_scheme", scheme, "'dynamic', 'static'")
        block = cfg.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise config_error("fp8", "weight_block_size", block, "two positive sizes [rows, columns]")
            if scheme != "dynamic":
                raise config_error("fp8", "activation_scheme", scheme, "'dynamic' with weight_block_size")
            block = (block[0], block[1])
        config = cls(block, tuple(cfg.get("ignored_layers") or cfg.get("modules_to_not_convert") or ()))
        if scheme == "static":
            config.notes.append(STATIC_NOTE)
        return config

    def linear_method(self):
        if self.block is not None:
            from pagedllm.layers.quantization.fp8_block import Fp8BlockLinearMethod

            return Fp8BlockLinearMethod(self.block, "weight_scale_inv", act_group=self.block[1])
        from pagedllm.layers.quantization.fp8 import Fp8LinearMethod

        return Fp8LinearMethod(serialized=True)

    def skip_suffixes(self) -> tuple[str, ...]:
        return UNUSED_SCALE_SUFFIXES
