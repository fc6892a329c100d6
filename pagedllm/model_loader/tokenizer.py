"""Loads the tokenizer for a model (an HF tokenizer directory, or the vocabulary inside a GGUF file) and
gives it its family's shipped chat template when the checkpoint carries none."""
from __future__ import annotations

import logging
import os
from typing import Any

from pagedllm.config import ModelConfig

logger = logging.getLogger(__name__)


def get_tokenizer(model_config: ModelConfig) -> Any | None:
    if model_config.skip_tokenizer_init:
        return None
    path = model_config.tokenizer or model_config.model
    if path.endswith(".gguf"):
        from pagedllm.model_loader.gguf_tokenizer import gguf_tokenizer

        tokenizer = gguf_tokenizer(path)
    else:
        from transformers import AutoTokenizer

        if not os.path.exists(path):
            from pagedllm.model_loader.hub import resolve_model_path

            path = resolve_model_path(path, None)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model_config.trust_remote_code)
    add_family_chat_template(tokenizer, model_config, path)
    return tokenizer


def _architecture_source(model_config: ModelConfig, arch: str) -> str:
    """How the architecture was known, for the log line: a GGUF's general.architecture, or the HF config."""
    if model_config.gguf_file or model_config.model.endswith(".gguf"):
        from pagedllm.model_loader.gguf_reader import ARCHITECTURES, WITH_EXPERTS

        tables = list(ARCHITECTURES.items()) + list(WITH_EXPERTS.items())  # Mixtral's file says 'llama'
        gguf_arch = next((k for k, (_, hf_arch) in tables if hf_arch == arch), None)
        if gguf_arch is not None:
            return f"GGUF general.architecture {gguf_arch!r}"
    return f"architecture {arch}"


def add_family_chat_template(tokenizer: Any, model_config: ModelConfig, path: str) -> None:
    """Sets the model family's shipped chat template on a tokenizer that has none.

    A checkpoint's own template is kept; one given per call or with --chat-template is passed to
    ``apply_chat_template`` and wins over both. Families without a shipped template are left alone,
    so chat keeps transformers' error that names the missing template.
    """
    if getattr(tokenizer, "chat_template", None):
        return
    from pagedllm.chat_templates import choose_family, load_template, template_path

    archs = list(getattr(model_config.hf_config, "architectures", None) or [])
    choice = choose_family(archs, tokenizer.get_vocab())
    if choice is None:
        return
    source = _architecture_source(model_config, choice.architecture)
    if choice.family is None:
        logger.info(
            "%s has no chat template, and pagedllm's template for its %s is not used: the vocabulary lacks %s",
            path, source, ", ".join(choice.missing),
        )
        return
    tokenizer.chat_template = load_template(choice.family.name)
    logger.info(
        "%s has no chat template; using pagedllm's %s template (%s), chosen from its %s",
        path, choice.family.title, template_path(choice.family.name), source,
    )


def chat_prompt_ids(tokenizer: Any, messages: list[dict], **kwargs: Any) -> list[int]:
    """Token ids of a conversation rendered by the tokenizer's chat template (kwargs pass through)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    # transformers 5 returns a BatchEncoding here, older releases a plain list.
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
