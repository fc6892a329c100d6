"""Quantized checkpoints of the real Gemma 3 270M (its GGUF dequantized to float32) for the accuracy tests and
``benchmarks/quant_quality.py``; ``python tests/gemma_quant_checkpoints.py [NAME ...]`` makes them (see MAKERS).

Cached under ``$PAGEDLLM_TEST_CACHE/quant`` beside the tiny ones, never committed:
- ``float32``: transformers' dequantization of the GGUF saved as a plain float32 checkpoint (with the tokenizer),
  the float reference every format is compared against;
- ``w8a8``: INT8 W8A8 (per-channel symmetric weights, dynamic per-token activations) made by compressed-tensors
  itself after SmoothQuant scales from the calibration text are folded in; ``w8a8-rtn`` without them;
  ``w8a8-asym``: activations with a zero point per token, SmoothQuant's strength chosen per layer and linear group;
  ``w8a8-quip``: every linear's input rotated online by a random Hadamard matrix (compressed-tensors'
  ``transform_config``, llm-compressor's QuIP "v" rotation), weights rounded to nearest;
- ``gptq-4b-g128`` (GPTQ's layout, symmetric, act-order) and ``awq-4b-g128`` (AutoAWQ's layout, zero points):
  calibrated by ``calibrated_quant`` (``GPTQ_RECIPE``, ``AWQ_RECIPE``) and packed by ``quant_checkpoints``, each
  with its dequantized float32 reference;
  ``rtn-4b-g128``: GPTQ's layout rounded to nearest, the baseline calibration must beat.
The field's calibrating tools do not install here: llm-compressor pins compressed-tensors and transformers below the
versions the suite needs, GPTQModel and AutoAWQ need CUDA builds. ``calibrated_quant`` follows their algorithms.
The calibration set (``benchmarks/data/calibration_second_inaugural.txt``, then the standard library's docstrings:
``calibration_sequences``) holds nothing of the scored text.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quant_checkpoints as qc  # noqa: E402

# The calibration text: public domain like the scored one, but other documents, so nothing is fitted to what is scored.
CALIBRATION_TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "data",
                                "calibration_second_inaugural.txt")


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


def _calibration_ids(float_dir: str, limit: int | None) -> list[int]:
    from transformers import AutoTokenizer

    with open(CALIBRATION_TEXT, encoding="utf-8") as f:
        ids = AutoTokenizer.from_pretrained(float_dir)(f.read())["input_ids"]
    return ids[:limit] if limit else ids


# Standard-library modules whose docstrings add English prose to the calibration set (read from the running
# interpreter, never shipped). A fixed list in a fixed order, so one Python gives one calibration set.
DOC_MODULES = ("argparse", "asyncio", "base64", "bisect", "calendar", "collections", "configparser", "contextlib",
               "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions",
               "functools", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http", "imaplib",
               "inspect", "io", "ipaddress", "itertools", "json", "locale", "logging", "mailbox", "math",
               "mimetypes", "numbers", "operator", "optparse", "os", "pathlib", "pickle", "pprint", "queue",
               "random", "re", "sched", "secrets", "selectors", "shlex", "shutil", "signal", "smtplib", "socket",
               "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap",
               "threading", "timeit", "tokenize", "traceback", "types", "typing", "unittest", "urllib", "uuid",
               "warnings", "weakref", "zipfile")


def stdlib_docs() -> str:
    """The docstrings of ``DOC_MODULES`` and of their public classes and functions (those over 200 characters),
    about 64k Gemma tokens on Python 3.11."""
    import importlib
    import inspect

    parts = []
    for name in DOC_MODULES:
        mod = importlib.import_module(name)
        parts.append(inspect.getdoc(mod) or "")
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if (not attr.startswith("_") and getattr(obj, "__module__", None) == name
                    and (inspect.isclass(obj) or inspect.isfunction(obj))):
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 200:
                    parts.append(doc)
    return "\n\n".join(p for p in parts if p)


def calibration_sequences(float_dir: str, tokens: int, seq_len: int = 512) -> list[list[int]]:
    """``tokens // seq_len`` sequences of ``seq_len`` token ids, each led by BOS: the calibration text, then the
    standard library's docstrings. GPTQ needs many more tokens than the calibration text holds: a Hessian of
    2,048 input channels from ~900 tokens is rank-deficient, and the rounding overfits it."""
    from transformers import AutoTokenizer

    with open(CALIBRATION_TEXT, encoding="utf-8") as f:
        text = f.read() + "\n\n" + stdlib_docs()
    ids = AutoTokenizer.from_pretrained(float_dir)(text)["input_ids"]
    bos, body = ids[0], ids[1:]
    count = tokens // seq_len
    if count * (seq_len - 1) > len(body):
        raise ValueError(f"calibration: {tokens} tokens asked, {len(body)} available")
    return [[bos] + body[i * (seq_len - 1):(i + 1) * (seq_len - 1)] for i in range(count)]


def _quantized_model(method: str, calibration_tokens: int | None, corpus_tokens: int | None = None, **kw):
    """The float model with its decoder linears quantized in place by ``calibrated_quant`` and the grids:
    calibrated on the calibration text's first ``calibration_tokens`` tokens as one sequence, or, where
    ``corpus_tokens`` is given, on that many tokens of ``calibration_sequences``."""
    from transformers import AutoModelForCausalLM

    import calibrated_quant as cq

    model = AutoModelForCausalLM.from_pretrained(float_model(), dtype=torch.float32).eval()
    ids = (_calibration_ids(float_model(), calibration_tokens) if corpus_tokens is None
           else calibration_sequences(float_model(), corpus_tokens))
    grids = cq.quantize_model(model, ids, method, **kw)
    return model, grids


def _stored(model) -> dict:
    """The model's tensors under the float checkpoint's names (no tied lm_head)."""
    names = set(_state())
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k in names}


def _calibration_name(calibration_tokens: int | None, corpus_tokens: int | None) -> str:
    return f"c{calibration_tokens or 'all'}" if corpus_tokens is None else f"docs{corpus_tokens}"


def gptq_name(method: str = "gptq", calibration_tokens: int | None = None, corpus_tokens: int | None = None,
              act_order: bool = False, damp: float = 0.01) -> str:
    name = f"gemma3-270m-{method}-4b-g128-{_calibration_name(calibration_tokens, corpus_tokens)}"
    return name + ("-act" if act_order else "") + ("" if damp == 0.01 else f"-damp{damp}")


def awq_name(calibration_tokens: int | None = None, corpus_tokens: int | None = None) -> str:
    return f"gemma3-270m-awq-g128-{_calibration_name(calibration_tokens, corpus_tokens)}"


def make_gptq(method: str = "gptq", calibration_tokens: int | None = None, *, corpus_tokens: int | None = None,
              act_order: bool = False, damp: float = 0.01) -> tuple[str, str]:
    """(checkpoint, reference) of GPTQ 4-bit group-128 symmetric in GPTQ's layout: ``method`` 'gptq' calibrated
    on the calibration text's first ``calibration_tokens`` tokens (or ``corpus_tokens`` of
    ``calibration_sequences``), 'rtn' rounded to nearest; ``act_order``, ``damp``: as ``calibrated_quant.gptq``
    (act-order stores each column's group, ``desc_act``). The reference holds the same integers dequantized."""
    def make(dst_q: str, dst_ref: str) -> None:
        model, grids = _quantized_model(method, calibration_tokens, corpus_tokens, group=128, sym=True,
                                        act_order=act_order, damp=damp)
        ref = _stored(model)
        tensors = dict(ref)
        for module, grid in grids.items():
            k = grid.q.shape[1]
            del tensors[module + ".weight"]
            tensors[module + ".qweight"] = qc._pack_rows(grid.q.t().contiguous(), 4)  # [K/8, N]
            # The original GPTQ layout stores zero points minus one.
            tensors[module + ".qzeros"] = qc._pack_rows((grid.zeros - 1).contiguous() & 15, 4).t()  # [G, N/8]
            tensors[module + ".scales"] = grid.scales.t().contiguous()  # [G, N]
            # Its own copy: linears sharing an input share a g_idx, and safetensors refuses shared tensors.
            g_idx = (torch.arange(k) // 128).to(torch.int32) if grid.g_idx is None else grid.g_idx.clone()
            tensors[module + ".g_idx"] = g_idx
        _write(dst_q, tensors, {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": act_order,
                                "sym": True, "checkpoint_format": "gptq"})
        _write(dst_ref, ref, None)

    return qc._pair(gptq_name(method, calibration_tokens, corpus_tokens, act_order, damp), make)


def make_awq(calibration_tokens: int | None = None, *, corpus_tokens: int | None = None) -> tuple[str, str]:
    """(checkpoint, reference) of AWQ 4-bit group-128 with zero points in AutoAWQ's layout, calibrated as
    ``make_gptq``; its scales are folded into the norms and up projections, which the checkpoint and the reference
    both hold."""
    def make(dst_q: str, dst_ref: str) -> None:
        model, grids = _quantized_model("awq", calibration_tokens, corpus_tokens, group=128)
        ref = _stored(model)
        tensors = dict(ref)
        for module, grid in grids.items():
            del tensors[module + ".weight"]
            tensors[module + ".qweight"] = qc._pack_awq(grid.q.t().contiguous())  # [K, N/8]
            tensors[module + ".qzeros"] = qc._pack_awq(grid.zeros.t().contiguous())  # [G, N/8]
            tensors[module + ".scales"] = grid.scales.t().contiguous()  # [G, N]
        _write(dst_q, tensors, {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                "version": "gemm", "modules_to_not_convert": None})
        _write(dst_ref, ref, None)

    return qc._pair(awq_name(calibration_tokens, corpus_tokens), make)


def make_ct_w8a8(smooth_alpha: float | str | None = 0.8, calibration_tokens: int | None = None,
                 act_symmetric: bool = True, rotated: bool = False) -> str:
    """INT8 W8A8 by compressed-tensors: per-channel symmetric weights, dynamic per-token activations (symmetric,
    or with a zero point each); ``smooth_alpha``: SmoothQuant's migration strength, its scales calibrated first
    ('auto': chosen per layer and linear group by the products' error; None: plain rounding); ``rotated``: every
    linear's input rotated by a random Hadamard matrix (QuIP's "v" rotation, compressed-tensors' transform_config,
    online at inference), the weights then rounded plainly: nothing calibrated."""
    def make(dst: str) -> None:
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import apply_quantization_config
        from transformers import AutoModelForCausalLM, AutoTokenizer

        fmt, qconfig = qc._ct_config("ct-w8a8" if act_symmetric else "ct-w8a8-asym-act")
        if smooth_alpha is None:
            model = AutoModelForCausalLM.from_pretrained(float_model(), dtype=torch.float32)
            if rotated:
                from compressed_tensors.transform import apply_transform_config

                apply_transform_config(model, qc.transform_config("random-hadamard", "v", None, True))
        else:
            model, _ = _quantized_model("smooth", calibration_tokens, smooth_alpha=smooth_alpha,
                                        act_symmetric=act_symmetric)
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
        AutoTokenizer.from_pretrained(float_model()).save_pretrained(dst)

    name = ("gemma3-270m-ct-w8a8-rtn" if smooth_alpha is None
            else f"gemma3-270m-ct-w8a8-smooth{smooth_alpha}-c{calibration_tokens or 'all'}")
    if not act_symmetric:
        name = name.replace("ct-w8a8", "ct-w8a8-asym")
    if rotated:
        name = name.replace("rtn", "quip-v")
    return qc._cached(name, make)


# The calibrated recipes the accuracy checks and the benchmark use: 16k tokens in 512-token sequences (the
# calibration text, then docstrings) for GPTQ, with act-order and 0.1 damping, which measured best here.
GPTQ_RECIPE = dict(corpus_tokens=16384, act_order=True, damp=0.1)
AWQ_RECIPE: dict = {}  # the calibration text alone: AWQ on 16k tokens measured worse (2.87x against 2.55x)

MAKERS = {  # name -> () -> (checkpoint, reference or None where compressed-tensors builds it)
    "float32": lambda: (float_model(), None),
    "w8a8": lambda: (make_ct_w8a8(), None),
    "w8a8-rtn": lambda: (make_ct_w8a8(None), None),
    "w8a8-asym": lambda: (make_ct_w8a8("auto", act_symmetric=False), None),
    "w8a8-quip": lambda: (make_ct_w8a8(None, rotated=True), None),
    "gptq-4b-g128": lambda: make_gptq(**GPTQ_RECIPE),
    "awq-4b-g128": lambda: make_awq(**AWQ_RECIPE),
    "rtn-4b-g128": lambda: make_gptq("rtn"),
}


# The cache name each maker writes, for is_made.
_NAMES = {"float32": "gemma3-270m-float32", "w8a8": "gemma3-270m-ct-w8a8-smooth0.8-call", "w8a8-rtn":
          "gemma3-270m-ct-w8a8-rtn", "w8a8-asym": "gemma3-270m-ct-w8a8-asym-smoothauto-call",
          "w8a8-quip": "gemma3-270m-ct-w8a8-quip-v", "gptq-4b-g128": gptq_name(**GPTQ_RECIPE),
          "awq-4b-g128": awq_name(**AWQ_RECIPE), "rtn-4b-g128": gptq_name("rtn")}


def is_made(name: str) -> bool:
    """Whether the named checkpoint is already in the cache."""
    return (qc.quant_cache() / f"{_NAMES[name]}-v{qc.VERSION}" / "config.json").is_file()


def make_all(names=None) -> dict:
    """The named checkpoints (default all): name -> (checkpoint, reference or None)."""
    return {name: MAKERS[name]() for name in (names or MAKERS)}


if __name__ == "__main__":
    for name, dirs in make_all(sys.argv[1:]).items():
        print(name, *dirs)
