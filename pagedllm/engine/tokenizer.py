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


def chat_prompt_ids(tokenizer: Any, messages: list[dict], **kwargs: Any) -> list[int]:
    """Token ids of a conversation rendered by the tokenizer's chat template (kwargs pass through)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    # transformers 5 returns a BatchEncoding here, older releases a plain list.
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
