"""Quantized checkpoints of the real Gemma 3 270M (its GGUF dequantized to float32) for the accuracy tests and
``benchmarks/quant_quality.py``; ``python tests/gemma_quant_checkpoints.py`` makes them all.

Cached under ``$PAGEDLLM_TEST_CACHE/quant`` beside the tiny ones, never committed:
- ``gemma3-270m-f32``: transformers' dequantization of the GGUF saved as a plain float32 checkpoint (with the
  tokenizer), the float reference every format is compared against;
- ``gemma3-270m-ct-w8a8``: INT8 W8A8 (per-channel symmetric weights, dynamic per-token activations) made by
  compressed-tensors itself, as ``quant_checkpoints.make_ct`` makes the tiny ones;
- ``gemma3-270m-gptq-4b-g128`` and ``gemma3-270m-awq-g128``: 4-bit group-128 in GPTQ's and AutoAWQ's layouts,
  packed by ``quant_checkpoints`` (GPTQModel and AutoAWQ do not install beside this CPU torch), each with its
  dequantized float32 reference.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quant_checkpoints as qc  # noqa: E402


def gguf_path() -> str:
    from pagedllm.model_loader.default_model import default_model_path

    return default_model_path()


def float_model() -> str:
    """The GGUF's weights dequantized by transformers, saved as float32 safetensors with the tokenizer."""
    def make(dst: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = gguf_path()
        folder, name = os.path.split(path)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # A model read from GGUF counts as quantized to transformers, which will not save it: the same weights go
        # into a plain model built from the config without its quantization entry.
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        model.save_pretrained(dst)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(dst)

    return qc._cached("gemma3-270m-float32", make)



def _state() -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(float_model(), "model.safetensors"))


def _write(dst: str, tensors: dict, quant_cfg: dict | None) -> None:
    """The float model's files with ``tensors`` as its weights and ``quant_cfg`` as its quantization_config."""
    import json
    import shutil

    from safetensors.torch import save_file

    src = float_model()
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if quant_cfg is not None:
        config["quantization_config"] = quant_cfg
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    for extra in os.listdir(src):
        if extra not in ("model.safetensors", "config.json") and os.path.isfile(os.path.join(src, extra)):
            shutil.copy(os.path.join(src, extra), dst)


def make_gptq() -> tuple[str, str]:
    """(checkpoint, reference) of GPTQ 4-bit group-128 symmetric, round to nearest on each group's range."""
    def make(dst_q: str, dst_ref: str) -> None:
        state = _state()
        tensors, ref = dict(state), dict(state)
        for module, _ in qc._linear_items(state):
            w = state[module + ".weight"].float()  # [N, K]
            k = w.shape[1]
            g_idx = (torch.arange(k) // 128).to(torch.int32)
            q, zeros, scales, deq = qc.gptq_quantize(w, 4, 128, True, g_idx, min_zero=1)
            del tensors[module + ".weight"]
            tensors[module + ".qweight"] = qc._pack_rows(q, 4)
            tensors[module + ".qzeros"] = qc._pack_rows((zeros - 1).t().contiguous() & 15, 4).t()
            tensors[module + ".scales"] = scales
            tensors[module + ".g_idx"] = g_idx
            ref[module + ".weight"] = deq
        _write(dst_q, tensors, {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                                "sym": True, "checkpoint_format": "gptq"})
        _write(dst_ref, ref, None)

    return qc._pair("gemma3-270m-rtn-gptq-4b-g128", make)


def make_awq() -> tuple[str, str]:
    """(checkpoint, reference) of AWQ 4-bit group-128 with zero points, round to nearest on each group's range."""
    def make(dst_q: str, dst_ref: str) -> None:
        state = _state()
        tensors, ref = dict(state), dict(state)
        for module, _ in qc._linear_items(state):
            w = state[module + ".weight"].float()  # [N, K]
            n, k = w.shape
            wg = w.reshape(n, k // 128, 128)
            lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [N, K/128]
            scales = ((hi - lo).clamp(min=1e-5) / 15).half()
            s = scales.float()
            zeros = torch.clamp(-torch.round(lo / s), 0, 15)
            q = torch.clamp(torch.round(wg / s[..., None]) + zeros[..., None], 0, 15)
            del tensors[module + ".weight"]
            tensors[module + ".qweight"] = qc._pack_awq(q.reshape(n, k).t().to(torch.int32))
            tensors[module + ".qzeros"] = qc._pack_awq(zeros.t().to(torch.int32))
            tensors[module + ".scales"] = scales.t().contiguous()
            ref[module + ".weight"] = ((q - zeros[..., None]) * s[..., None]).reshape(n, k)
        _write(dst_q, tensors, {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                "version": "gemm", "modules_to_not_convert": None})
        _write(dst_ref, ref, None)

    return qc._pair("gemma3-270m-rtn-awq-g128", make)


def make_ct_w8a8() -> str:
    """INT8 W8A8 by compressed-tensors: per-channel symmetric weights, dynamic per-token symmetric activations."""
    def make(dst: str) -> None:
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import apply_quantization_config
        from transformers import AutoModelForCausalLM

        fmt, qconfig = qc._ct_config("ct-w8a8")
        model = AutoModelForCausalLM.from_pretrained(float_model(), dtype=torch.float32)
        apply_quantization_config(model, qconfig)
        with torch.no_grad():
            for module in model.modules():
                scheme = getattr(module, "quantization_scheme", None)
                if scheme is None or scheme.weights is None:
                    continue
                scale, zero = qc._weight_qparams(module.weight.data, scheme.weights)
                module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
        compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
        compressor.compress_model(model)
        model.save_pretrained(dst)
        compressor.update_config(dst)
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(float_model()).save_pretrained(dst)

    return qc._cached("gemma3-270m-ct-w8a8-rtn", make)


def make_all() -> dict:
    """Every checkpoint: name -> (checkpoint, reference or None where the library builds it)."""
    gptq, gptq_ref = make_gptq()
    awq, awq_ref = make_awq()
    return {"float32": (float_model(), None), "w8a8": (make_ct_w8a8(), None), "gptq-4b-g128": (gptq, gptq_ref),
            "awq-4b-g128": (awq, awq_ref)}


if __name__ == "__main__":
    for name, dirs in make_all().items():
        print(name, *dirs)
