"""Loads the tokenizer for a model: an HF tokenizer directory, or the vocabulary inside a GGUF file."""
from __future__ import annotations

import os
from typing import Any

from pagedllm.config import ModelConfig


def get_tokenizer(model_config: ModelConfig) -> Any | None:
    if model_config.skip_tokenizer_init:
        return None
    path = model_config.tokenizer or model_config.model
    if path.endswith(".gguf"):
        from pagedllm.model_loader.gguf_loader import gguf_tokenizer

        return gguf_tokenizer(path)
    from transformers import AutoTokenizer

    if not os.path.exists(path):
        from pagedllm.model_loader.hub import resolve_model_path

        path = resolve_model_path(path, None)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=model_config.trust_remote_code)
