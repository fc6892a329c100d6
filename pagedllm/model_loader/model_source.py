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


# Files beside config.json that older quantizers state their quantization in, and the quant_method each implies
# when the file names none: NVIDIA Model Optimizer's older exports, AutoGPTQ (GPTQModel writes it too), AutoAWQ.
_SIDE_CONFIGS = (("hf_quant_config.json", "modelopt"), ("quantize_config.json", "gptq"), ("quant_config.json", "awq"))


def _side_quant_config(hf_config: Any, path: str) -> str | None:
    """A checkpoint whose config.json has no ``quantization_config`` but whose quantizer wrote its settings into a
    file of its own gets them as its ``quantization_config``, as newer exports write it; returns the file read.

    Model Optimizer's ``{"quantization": {"quant_algo": ...}}`` becomes ``quant_method`` ``modelopt``; AutoAWQ's
    ``{"w_bit", "q_group_size", "zero_point", "version"}`` (in either file) ``awq``; AutoGPTQ's ``{"bits",
    "group_size", "desc_act", "sym"}`` ``gptq``; a ``quant_method`` the file names wins."""
    if getattr(hf_config, "quantization_config", None) is not None:
        return None
    for name, method in _SIDE_CONFIGS:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        with open(file) as f:
            cfg = json.load(f)
        if not isinstance(cfg, dict):
            continue
        if method == "modelopt":
            if not isinstance(cfg.get("quantization"), dict):
                continue
            cfg = {"quant_method": method, **cfg["quantization"]}
        elif "quant_method" not in cfg:
            cfg = {"quant_method": "awq" if "w_bit" in cfg or "q_group_size" in cfg else method, **cfg}
        from pagedllm.layers.quantization.registry import parse_quantization_config

        try:  # refused here, so that the error names the file the settings came from
            parse_quantization_config(cfg)
        except (ValueError, NotImplementedError) as e:
            raise type(e)(f"{file}: {e}") from None
        hf_config.quantization_config = cfg
        return name
    return None


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
    _side_quant_config(hf_config, path)
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
