"""Tiny random HF checkpoints (a few hundred KB, float32, seeded) for testing the model code without the hub."""
from __future__ import annotations

import os

import torch

_BASE = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

# kind -> (HF model_type, config overrides)
_KINDS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # Small, so the tiny head_dim has low, medium and high frequency bands.
                "original_max_position_embeddings": 64,
            }
        },
    ),
    # Wide enough for 128-channel quantization groups and 128x128 float8 blocks (q 256, k/v 128 outputs).
    "llama-wide": ("llama", {"hidden_size": 256, "intermediate_size": 512}),
    "llama-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    # A window shorter than the test prompts so the sliding mask is exercised.
    "mistral": ("mistral", {"sliding_window": 10}),
    "qwen2": ("qwen2", {}),
    "qwen2-yarn": (
        "qwen2",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 512,
            }
        },
    ),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "phi3": ("phi3", {}),
    "phi3-longrope": (
        "phi3",
        {
            "original_max_position_embeddings": 512,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
            },
        },
    ),
    # Sliding (window 8, shorter than the test prompts) and global layers, each type with its own
    # rotary (the global one scaled, as in Gemma 3 4B+); a scale unlike head_dim**-0.5; soft-capped logits.
    "gemma3": (
        "gemma3_text",
        {
            "num_hidden_layers": 3,
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
            },
            "final_logit_softcapping": 2.0,
            "tie_word_embeddings": True,
        },
    ),
    # Mixture-of-experts: top-2 of 8, renormalised (Mixtral always renormalises).
    "mixtral": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}),
    # Top-1 of 8 without renormalising, a shared expert, and a dense first layer (decoder_sparse_step 2).
    "qwen2_moe": (
        "qwen2_moe",
        {"num_experts": 8, "num_experts_per_tok": 1, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "decoder_sparse_step": 2},
    ),
    # Top-8 of 16, renormalised, q/k norms; the middle of three layers dense (mlp_only_layers).
    "qwen3_moe": (
        "qwen3_moe",
        {"num_hidden_layers": 3, "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 8,
         "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1]},
    ),
}

TINY_KINDS = tuple(_KINDS)


def tiny_config(kind: str, **extra):
    """``extra``: config fields over the kind's own (e.g. a vocabulary or layer count a test needs)."""
    from transformers import AutoConfig

    if kind not in _KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose one of {', '.join(_KINDS)}")
    model_type, overrides = _KINDS[kind]
    kwargs = {**_BASE, **overrides, **extra}
    config = AutoConfig.for_model(model_type, **kwargs)
    config.dtype = torch.float32
    return config


def make_tiny_model(kind: str, path: str | os.PathLike, seed: int = 0, **config_overrides) -> str:
    """Writes a tiny random ``kind`` model (config.json + model.safetensors) to ``path`` and returns it.

    Norm weights and biases are randomized too (HF initializes them to 1 and 0), so a parity test
    notices a norm or bias that is loaded into the wrong place.
    """
    from transformers import AutoModelForCausalLM

    path = os.fspath(path)
    config = tiny_config(kind, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_model_with_tokenizer(tok_name: str, path: str | os.PathLike) -> str:
    """A tiny random Llama sized to a real tokenizer's vocabulary, with that tokenizer's files beside it."""
    import shutil

    from assets import tokenizer_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tdir = tokenizer_dir(tok_name)
    tok = AutoTokenizer.from_pretrained(tdir)
    config = tiny_config("llama")
    config.vocab_size = len(tok)
    config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    config.pad_token_id = None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    for f in tdir.iterdir():
        shutil.copy(f, path)
    return os.fspath(path)


_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_fp8_checkpoint(src: str, dst: str, quant_cfg: dict, per_channel: bool, input_scales: bool = False,
                        keep: tuple[str, ...] = ()) -> str:
    """``src`` (a tiny model's directory) with every decoder linear but those named in ``keep`` stored in
    float8 with its scales: one a row (``per_channel``, the scales [N, 1]) or one a tensor. ``quant_cfg``
    goes into config.json; ``input_scales`` adds static activation scales. Returns ``dst``."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from pagedllm.layers.quantization.fp8 import FP8_DTYPE, quantize_rows_ref

    os.makedirs(dst, exist_ok=True)
    tensors = {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        if name.endswith(".weight") and name.split(".")[-2] in _LINEARS and name.split(".")[-2] not in keep:
            if per_channel:
                q, s = quantize_rows_ref(t)  # s [N, 1], the compressed-tensors channel layout
            else:
                s = t.float().abs().amax().reshape(1) / 448.0
                q = (t.float() / s).clamp(-448, 448).to(FP8_DTYPE)
            tensors[name] = q
            tensors[name[: -len("weight")] + "weight_scale"] = s
            if input_scales:
                tensors[name[: -len("weight")] + "input_scale"] = torch.ones(1)
        else:
            tensors[name] = t
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quant_cfg
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    for extra in os.listdir(src):
        if extra not in ("model.safetensors", "config.json"):
            shutil.copy(os.path.join(src, extra), dst)
    return dst


def compressed_tensors_fp8_config(strategy: str, dynamic: bool = True) -> dict:
    """The ``quantization_config`` of llm-compressor's float8 schemes: weights per ``strategy``, activations per token."""
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": dynamic},
        }},
    }
