"""ModelSource: where a model's weights, config, generation defaults and tokenizer come from."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelSource:
    model_path: str  # directory of an HF checkpoint, or a .gguf file
    tokenizer_path: str | None
    hf_config: Any  # transformers PretrainedConfig of the text model
    load_format: str  # resolved: safetensors | pt | dummy | gguf
    generation_config: dict = field(default_factory=dict)
    gguf_file: str | None = None


def _text_config(hf_config: Any) -> Any:
    # Multimodal checkpoints wrap the language model's config; the engine serves the text model.
    text = getattr(hf_config, "text_config", None)
    if text is not None and getattr(text, "num_hidden_layers", None):
        if not getattr(text, "architectures", None):
            text.architectures = [a.replace("ForConditionalGeneration", "ForCausalLM") for a in hf_config.architectures or []]
        return text
    return hf_config


def _modelopt_config(hf_config: Any, path: str) -> None:
    """NVIDIA Model Optimizer's older exports state their quantization only in ``hf_quant_config.json``
    (``{"quantization": {"quant_algo": ...}}``); it becomes the config's ``quantization_config``, as newer exports
    write it."""
    file = os.path.join(path, "hf_quant_config.json")
    if getattr(hf_config, "quantization_config", None) is not None or not os.path.isfile(file):
        return
    with open(file) as f:
        quantization = json.load(f).get("quantization")
    if isinstance(quantization, dict):
        hf_config.quantization_config = {"quant_method": "modelopt", **quantization}


def _generation_defaults(path: str) -> dict:
    try:
        from transformers import GenerationConfig

        gc = GenerationConfig.from_pretrained(path)
    except (OSError, ValueError):
        return {}
    keys = ("eos_token_id", "bos_token_id", "temperature", "top_p", "top_k", "repetition_penalty", "do_sample")
    return {k: getattr(gc, k) for k in keys if getattr(gc, k, None) is not None}


def load_model_source(
    model: str | None,
    tokenizer: str | None,
    load_format: str,
    download_dir: str | None,
    trust_remote_code: bool,
    gguf_packed: bool = False,
) -> ModelSource:
    """Resolves a model name (local dir, .gguf file, hub id, or None for the default model).

    ``gguf_packed``: a GGUF file will keep its weights packed, so it loads from the file itself; otherwise an
    earlier start's dequantized copy (``gguf_cache.py``) is used when there is one."""
    from transformers import AutoConfig

    from pagedllm.model_loader.hub import resolve_model_path

    if model is None:
        from pagedllm.model_loader.default_model import default_model_path

        model = default_model_path()
    is_gguf = load_format == "gguf" or str(model).endswith(".gguf")
    if is_gguf:
        from pagedllm.model_loader.gguf_loader import gguf_hf_config

        from pagedllm.model_loader.gguf_cache import find_converted

        path = os.path.abspath(model)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file {model!r} does not exist")
        converted = find_converted(path) if load_format != "gguf" and not gguf_packed else None
        if converted is not None:
            # An earlier start converted this file: load its float32 safetensors, skip the GGUF.
            return ModelSource(
                model_path=str(converted),
                tokenizer_path=tokenizer or path,
                hf_config=_text_config(AutoConfig.from_pretrained(converted)),
                load_format="safetensors",
                gguf_file=path,
            )
        hf_config = gguf_hf_config(path)
        return ModelSource(
            model_path=path,
            tokenizer_path=tokenizer or path,
            hf_config=_text_config(hf_config),
            load_format="gguf",
            gguf_file=path,
        )
    path = resolve_model_path(model, download_dir)
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    _modelopt_config(hf_config, path)
    if load_format == "auto":
        files = os.listdir(path)
        if any(f.endswith(".safetensors") for f in files):
            load_format = "safetensors"
        elif any(f.endswith(".bin") or f.endswith(".pt") for f in files):
            load_format = "pt"
        else:
            raise FileNotFoundError(
                f"no weights (*.safetensors, *.bin) in {path}; use load_format='dummy' for random weights"
            )
    return ModelSource(
        model_path=path,
        tokenizer_path=tokenizer or path,
        hf_config=_text_config(hf_config),
        load_format=load_format,
        generation_config=_generation_defaults(path),
    )
