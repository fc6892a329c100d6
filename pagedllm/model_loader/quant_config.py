"""Reads a checkpoint's ``quantization_config`` into the quantization method's config (``layers/quantization/``),
before anything is loaded: an unknown method or a setting the method cannot hold is refused here, naming it."""
from __future__ import annotations

import logging
from typing import Any

from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.layers.quantization.registry import parse_quantization_config

logger = logging.getLogger("pagedllm")


def checkpoint_quant_config(hf_config: Any, warn: bool = True) -> QuantizationConfig | None:
    """The config the checkpoint's ``quantization_config`` declares, None for an unquantized checkpoint.
    ``warn``: log what of the checkpoint goes unused."""
    cfg = getattr(hf_config, "quantization_config", None)
    if cfg is None:
        return None
    if not isinstance(cfg, dict):
        cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else vars(cfg)
    config = parse_quantization_config(cfg)
    if warn:
        for note in config.notes:
            logger.warning(note)
    return config
