"""Reads a checkpoint's ``quantization_config``: which float8 checkpoints load as stored, and a clear error for the rest.

Two serialized float8 layouts are read, both with float8 e4m3 ``weight`` tensors beside float32
``weight_scale`` tensors:
- compressed-tensors (llm-compressor's ``FP8``/``FP8-dynamic`` schemes): ``quant_method``
  ``compressed-tensors``, ``format`` ``float-quantized`` (or ``naive-quantized``), 8-bit float weights
  with ``strategy`` ``channel`` (scales [N, 1]) or ``tensor`` (one scale);
- vLLM's own ``fp8`` layout (AutoFP8): ``quant_method`` ``fp8`` with one scale per weight tensor.
Activations are always quantized per token at run time, as ``--quantization fp8`` does. A checkpoint
whose activation scales are static (``input_scale`` tensors) therefore loads with them unused, and
its products round a little differently from an engine that applies those scales.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("pagedllm")

# Checkpoint tensors of these suffixes hold scales this engine does not use.
UNUSED_SCALE_SUFFIXES = (".input_scale", ".output_scale", ".k_scale", ".v_scale", ".kv_scale")


@dataclass(frozen=True)
class Fp8CheckpointSpec:
    """How a float8 checkpoint stores its linears."""

    source: str  # "compressed-tensors" or "fp8"
    weight_strategy: str  # "channel" (a scale per output row) or "tensor" (one scale a tensor)
    static_activations: bool  # the checkpoint carries input_scale tensors (unused here)
    ignore: tuple[str, ...] = ()  # module names kept unquantized; "re:" entries are regular expressions

    def ignores(self, module_name: str) -> bool:
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], module_name):
                    return True
            elif module_name == entry:
                return True
        return False


def _unsupported(method: str, detail: str) -> NotImplementedError:
    return NotImplementedError(
        f"checkpoint quantization {method!r} ({detail}) is not supported; pagedllm loads float8 checkpoints "
        "(compressed-tensors float-quantized 8-bit weights per channel or per tensor, or vLLM's 'fp8' with "
        "per-tensor scales), or quantizes a 16/32-bit checkpoint at load with --quantization fp8"
    )


def _compressed_tensors(cfg: dict) -> Fp8CheckpointSpec:
    fmt = cfg.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _unsupported("compressed-tensors", f"format {fmt!r}")
    groups = list((cfg.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _unsupported("compressed-tensors", f"{len(groups)} config groups")
    weights = groups[0].get("weights") or {}
    if weights.get("num_bits") != 8 or weights.get("type") != "float":
        raise _unsupported("compressed-tensors", f"{weights.get('num_bits')}-bit {weights.get('type')} weights")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor"):
        raise _unsupported("compressed-tensors", f"weight strategy {strategy!r}")
    acts = groups[0].get("input_activations") or {}
    static = bool(acts) and not acts.get("dynamic", False)
    return Fp8CheckpointSpec("compressed-tensors", strategy, static, tuple(cfg.get("ignore") or ()))


def _vllm_fp8(cfg: dict) -> Fp8CheckpointSpec:
    if cfg.get("weight_block_size"):
        raise _unsupported("fp8", f"block-wise scales, weight_block_size {cfg['weight_block_size']}")
    scheme = cfg.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _unsupported("fp8", f"activation_scheme {scheme!r}")
    return Fp8CheckpointSpec("fp8", "tensor", scheme == "static", tuple(cfg.get("ignored_layers") or ()))


def checkpoint_fp8_spec(hf_config: Any, warn: bool = True) -> Fp8CheckpointSpec | None:
    """The float8 layout the checkpoint's config declares, None for an unquantized checkpoint; raises for
    any other quantization, naming it. ``warn``: log what of the checkpoint goes unused."""
    cfg = getattr(hf_config, "quantization_config", None)
    if cfg is None:
        return None
    if not isinstance(cfg, dict):
        cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else vars(cfg)
    method = cfg.get("quant_method")
    if method == "compressed-tensors":
        spec = _compressed_tensors(cfg)
    elif method == "fp8":
        spec = _vllm_fp8(cfg)
    else:
        raise _unsupported(str(method), "quant_method")
    if spec.static_activations and warn:
        logger.warning("checkpoint has static activation scales; pagedllm quantizes activations per token at "
                       "run time instead and leaves the input_scale tensors unused")
    return spec
