"""Quantized checkpoints of a tiny random Llama for the tests, each with the float reference it must reproduce.

Made once and cached under ``$PAGEDLLM_TEST_CACHE/quant`` (``python tests/quant_checkpoints.py`` makes them all):
- compressed-tensors formats by compressed-tensors itself (its quantization parameters, its compressors, its
  ``config.json``); the reference is the float model whose linears hold compressed-tensors' own decompression
  of the saved tensors, with its forward wrappers quantizing activations where the scheme says so.
- GPTQ and AWQ by this file, following their published layouts (GPTQModel and AutoAWQ do not install beside
  this CPU torch): integer weights, zero points and float16 scales from each group's range, packed word by
  word; the reference holds ``(q - z) * s`` computed from the same integers before packing.
A checkpoint directory holds config.json and model.safetensors; its reference directory (``<name>-reference``)
a plain float32 checkpoint that transformers loads, except for compressed-tensors, whose reference is built in
memory by ``reference_model``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from assets import cache_root  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

VERSION = 1  # bump when a maker changes, so stale caches are not reused
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Linears that read the same input: GPTQ's act-order permutes their inputs alike.
_SAME_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble j of a word holds column AWQ_ORDER[j]


def quant_cache() -> Path:
    return cache_root() / "quant"


def _cached(name: str, make) -> str:
    """``make(tmp_dir)`` once into the cache, renamed whole so that concurrent runs never see half a directory."""
    dest = quant_cache() / f"{name}-v{VERSION}"
    if (dest / "config.json").is_file():
        return str(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent))
    try:
        make(str(tmp))
        try:
            tmp.rename(dest)
        except OSError:
            if not (dest / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def base_model() -> str:
    """The float32 model every checkpoint quantizes: 256 hidden, 512 intermediate, q 256 and k/v 128 outputs."""
    return _cached("llama-wide", lambda d: make_tiny_model("llama-wide", d))


def _linear_items(state: dict) -> list[tuple[str, str]]:
    """(module name, linear kind) of every decoder linear in a state dict."""
    return sorted((k[: -len(".weight")], k.split(".")[-2]) for k in state
                  if k.endswith(".weight") and k.split(".")[-2] in LINEARS)


def _write(dst: str, tensors: dict, quant_cfg: dict | None, src: str | None = None) -> None:
    """``tensors`` as ``src``'s checkpoint (default: the base model's config and files) with ``quant_cfg``."""
    from safetensors.torch import save_file

    src = src or base_model()
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if quant_cfg is not None:
        config["quantization_config"] = quant_cfg
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    for extra in os.listdir(src):
        if extra not in ("model.safetensors", "config.json"):
            shutil.copy(os.path.join(src, extra), dst)


def _base_state() -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(base_model(), "model.safetensors"))


# ---- GPTQ ---------------------------------------------------------------------------------------------------


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] unsigned ints -> [R * bits / 32, C] int32: row i into bits (i % per) * bits of word i // per."""
    per = 32 // bits
    out = torch.zeros(values.shape[0] // per, values.shape[1], dtype=torch.int64)
    for j in range(per):
        out |= values[j::per].to(torch.int64) << (bits * j)
    return (out - (out >= 2**31) * 2**32).to(torch.int32)


def gptq_quantize(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor, min_zero: int = 0):
    """GPTQ's round-to-nearest grid per (row, group): scales [G, N] float16, zeros [G, N], q [K, N]; the dequantized
    weight [N, K] from those integers and the float16 scales. ``min_zero`` 1: the original format stores zero
    points minus one in ``bits`` bits, so a zero point of 0 cannot be stored."""
    n, k = w.shape
    maxq = 2**bits - 1
    n_groups = int(g_idx.max()) + 1
    scales = torch.empty(n_groups, n)
    zeros = torch.empty(n_groups, n)
    for gi in range(n_groups):
        cols = w[:, g_idx == gi]
        lo = cols.amin(dim=1).clamp(max=0)
        hi = cols.amax(dim=1).clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        s = ((hi - lo) / maxq).clamp(min=1e-8)
        scales[gi] = s
        zeros[gi] = torch.full_like(s, (maxq + 1) // 2) if sym else torch.round(-lo / s).clamp(min_zero, maxq)
    scales = scales.half()
    s_k = scales.float()[g_idx]  # [K, N]
    z_k = zeros[g_idx]
    q = torch.clamp(torch.round(w.t() / s_k + z_k), 0, maxq)
    deq = ((q - z_k) * s_k).t()
    return q.to(torch.int32), zeros.to(torch.int32), scales, deq


def make_gptq(bits: int, group: int, desc_act: bool, sym: bool, fmt: str = "gptq",
              skip: str | None = None) -> tuple[str, str]:
    """(checkpoint, reference) directories of a GPTQ checkpoint; ``group`` -1 is one group a row. ``skip``: a
    regular expression of modules kept in float, stated as GPTQModel does (a "-:" rule in ``dynamic``, beside a "+:"
    rule that repeats the bits)."""
    name = f"gptq-{bits}b-g{group}-{'act' if desc_act else 'noact'}-{'sym' if sym else 'asym'}-{fmt}"
    if skip is not None:
        name += "-skip-" + "".join(c for c in skip if c.isalnum())

    def make(dst_q: str, dst_ref: str) -> None:
        state = _base_state()
        gen = torch.Generator().manual_seed(1234)
        perms: dict[str, torch.Tensor] = {}
        tensors, ref = dict(state), dict(state)
        for module, kind in _linear_items(state):
            if skip is not None and re.match(skip, module):
                continue
            w = state[module + ".weight"].float()
            k = w.shape[1]
            g = k if group == -1 else group
            order = torch.arange(k)
            if desc_act:  # the same input order for linears that read the same input, as GPTQ's Hessian gives
                key = module.rsplit(".", 1)[0] + "." + _SAME_INPUT.get(kind, kind)
                order = perms.setdefault(key, torch.randperm(k, generator=gen))
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[order] = (torch.arange(k) // g).to(torch.int32)
            q, zeros, scales, deq = gptq_quantize(w, bits, g, sym, g_idx, min_zero=1 if fmt == "gptq" else 0)
            stored_zeros = zeros - (1 if fmt == "gptq" else 0)
            del tensors[module + ".weight"]
            tensors[module + ".qweight"] = _pack_rows(q, bits)
            tensors[module + ".qzeros"] = _pack_rows(stored_zeros.t().contiguous() & (2**bits - 1), bits).t()
            tensors[module + ".scales"] = scales
            tensors[module + ".g_idx"] = g_idx
            ref[module + ".weight"] = deq
        cfg = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
               "checkpoint_format": fmt}
        if skip is not None:
            cfg["dynamic"] = {"-:" + skip: {}, "+:.*mlp.*": {"bits": bits}}
        _write(dst_q, tensors, cfg)
        _write(dst_ref, ref, None)

    return _pair(name, make)


def _pair(name: str, make) -> tuple[str, str]:
    """Makes the checkpoint and its reference together (one call writes both) and caches each."""
    ref_dir = quant_cache() / f"{name}-reference-v{VERSION}"
    made: dict[str, str] = {}

    def make_q(dst_q: str) -> None:
        tmp_ref = tempfile.mkdtemp(dir=quant_cache())
        make(dst_q, tmp_ref)
        made["ref"] = tmp_ref

    ckpt = _cached(name, make_q)
    if "ref" in made:
        shutil.rmtree(ref_dir, ignore_errors=True)
        os.rename(made["ref"], ref_dir)
    if not (ref_dir / "config.json").is_file():  # reference lost: make both again
        shutil.rmtree(ckpt)
        return _pair(name, make)
    return ckpt, str(ref_dir)


# ---- AWQ ----------------------------------------------------------------------------------------------------


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, C] 4-bit ints -> [R, C / 8] int32 in AutoAWQ's interleaved order."""
    out = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for j, col in enumerate(AWQ_ORDER):
        out |= values[:, col::8].to(torch.int64) << (4 * j)
    return (out - (out >= 2**31) * 2**32).to(torch.int32)


def make_awq(group: int) -> tuple[str, str]:
    def make(dst_q: str, dst_ref: str) -> None:
        state = _base_state()
        tensors, ref = dict(state), dict(state)
        for module, _ in _linear_items(state):
            w = state[module + ".weight"].float()  # [N, K]
            n, k = w.shape
            wg = w.reshape(n, k // group, group)
            lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [N, K/g]
            # AutoAWQ's asymmetric grid: 15 steps between the group's extremes, an integer zero point.
            scales = ((hi - lo).clamp(min=1e-5) / 15).half()
            s = scales.float()
            zeros = torch.clamp(-torch.round(lo / s), 0, 15)
            q = torch.clamp(torch.round(wg / s[..., None]) + zeros[..., None], 0, 15)
            deq = ((q - zeros[..., None]) * s[..., None]).reshape(n, k)
            del tensors[module + ".weight"]
            tensors[module + ".qweight"] = _pack_awq(q.reshape(n, k).t().to(torch.int32))
            tensors[module + ".qzeros"] = _pack_awq(zeros.t().to(torch.int32))
            tensors[module + ".scales"] = scales.t().contiguous()
            ref[module + ".weight"] = deq
        _write(dst_q, tensors, {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                "version": "gemm", "modules_to_not_convert": None})
        _write(dst_ref, ref, None)

    return _pair(f"awq-g{group}", make)


# ---- compressed-tensors -------------------------------------------------------------------------------------

# name -> (format, scheme fields, and the ignore list where not just lm_head); every scheme targets the linears.
CT_SCHEMES: dict[str, tuple[str, dict]] = {
    "ct-w4a16-g128-sym": ("pack-quantized", {"weights": dict(num_bits=4, type="int", symmetric=True, strategy="group",
                                                             group_size=128)}),
    "ct-w4a16-g64-asym": ("pack-quantized", {"weights": dict(num_bits=4, type="int", symmetric=False, strategy="group",
                                                             group_size=64)}),
    "ct-w4a16-channel": ("pack-quantized", {"weights": dict(num_bits=4, type="int", symmetric=True, strategy="channel")}),
    "ct-w8a16-g32": ("pack-quantized", {"weights": dict(num_bits=8, type="int", symmetric=True, strategy="group",
                                                        group_size=32)}),
    "ct-w8a8": ("int-quantized", {
        "weights": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
        "input_activations": dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)}),
    "ct-w8a8-asym-act": ("int-quantized", {
        "weights": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
        "input_activations": dict(num_bits=8, type="int", symmetric=False, strategy="token", dynamic=True)}),
    # The MLP's down projections listed as unquantized: they load as float weights.
    "ct-w4a16-g128-ignore-down": ("pack-quantized", {"weights": dict(num_bits=4, type="int", symmetric=True,
                                                                     strategy="group", group_size=128),
                                                     "ignore": ["lm_head", "re:.*mlp\\.down_proj"]}),
    # Online rotations (compressed-tensors' transform_config, llm-compressor's QuIP): (type, groups, head_dim,
    # randomize); group "v" rotates each linear's input, "u" its output.
    "ct-w8a8-quip": ("int-quantized", {
        "weights": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
        "input_activations": dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True),
        "transforms": ("random-hadamard", "vu", None, True)}),
    "ct-w8a8-hadamard-b64": ("int-quantized", {
        "weights": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
        "input_activations": dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True),
        "transforms": ("hadamard", "v", 64, False)}),
    "ct-w4a16-random-matrix": ("pack-quantized", {
        "weights": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128),
        "transforms": ("random-matrix", "vu", 32, False)}),
    "ct-fp8-block": ("float-quantized", {
        "weights": dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128]),
        "input_activations": dict(num_bits=8, type="float", symmetric=True, strategy="group", group_size=128,
                                  dynamic=True)}),
}


def _ct_config(name: str):
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    fmt, scheme = CT_SCHEMES[name]
    scheme = dict(scheme)
    ignore = scheme.pop("ignore", ["lm_head"])
    scheme.pop("transforms", None)
    return fmt, QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
                                   ignore=ignore)


def transform_config(kind: str, groups: str, head_dim: int | None, randomize: bool):
    """compressed-tensors' TransformConfig of QuIP's rotations over every linear but lm_head: group "v" rotates a
    linear's input online (its inverse fused into the weight), "u" its output."""
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme

    where = dict(targets=["Linear"], ignore=["lm_head"])
    places = {"v": [TransformArgs(location="input", **where),
                    TransformArgs(location="weight_input", inverse=True, **where)],
              "u": [TransformArgs(location="weight_output", **where),
                    TransformArgs(location="output", inverse=True, **where)]}
    return TransformConfig(config_groups={g: TransformScheme(type=kind, apply=places[g], randomize=randomize,
                                                             head_dim=head_dim) for g in groups})


def _weight_qparams(w: torch.Tensor, args):
    """compressed-tensors' scale and zero point for ``w`` [N, K] under ``args``, from each group's range."""
    from compressed_tensors.quantization.utils import calculate_qparams

    n, k = w.shape
    if args.strategy == "group":
        wg = w.reshape(n, k // args.group_size, args.group_size)
        lo, hi = wg.amin(-1), wg.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    elif args.strategy == "block":
        bn, bk = args.block_structure
        wb = w.reshape(n // bn, bn, k // bk, bk)
        lo, hi = wb.amin(dim=(1, 3)), wb.amax(dim=(1, 3))
    else:
        raise ValueError(f"no weight range for strategy {args.strategy}")
    return calculate_qparams(lo, hi, args)


def make_ct(name: str) -> str:
    def make(dst: str) -> None:
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import apply_quantization_config
        from transformers import AutoModelForCausalLM

        fmt, qconfig = _ct_config(name)
        model = AutoModelForCausalLM.from_pretrained(base_model(), dtype=torch.float32)
        transforms = CT_SCHEMES[name][1].get("transforms")
        if transforms is not None:
            from compressed_tensors.transform import apply_transform_config

            apply_transform_config(model, transform_config(*transforms))
        apply_quantization_config(model, qconfig)
        with torch.no_grad():
            for module in model.modules():
                scheme = getattr(module, "quantization_scheme", None)
                if scheme is None or scheme.weights is None:
                    continue
                scale, zero = _weight_qparams(module.weight.data, scheme.weights)
                module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
        compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
        compressor.compress_model(model)
        model.save_pretrained(dst)
        compressor.update_config(dst)

    return _cached(name, make)


def ct_reference_model(path: str, float_dir: str | None = None):
    """The float model of a compressed-tensors checkpoint as the library reads it: each quantized linear's weight is
    compressed-tensors' own decompression of the stored tensors; activations go through its quantized forward.
    ``float_dir``: the float checkpoint it was made from (default: the tiny base model)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(os.path.join(path, "config.json")) as f:
        qcfg = json.load(f)["quantization_config"]
    config = AutoConfig.from_pretrained(float_dir or base_model())
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if (qcfg.get("transform_config") or {}).get("config_groups"):
        # Its online rotations hook around the linears; their matrices are loaded from the checkpoint below.
        from compressed_tensors.transform import TransformConfig, apply_transform_config

        apply_transform_config(model, TransformConfig.model_validate(qcfg["transform_config"]))
    qconfig = QuantizationConfig.model_validate({k: v for k, v in qcfg.items() if k in QuantizationConfig.model_fields})
    apply_quantization_config(model, qconfig)
    compressor = BaseCompressor.get_value_from_registry(qcfg["format"])
    state = load_file(os.path.join(path, "model.safetensors"))
    plain = {}
    quantized = {name: m for name, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    for key, tensor in state.items():
        if key.rsplit(".", 1)[0] not in quantized:
            plain[key] = tensor
    missing, unexpected = model.load_state_dict(plain, strict=False)
    assert not unexpected, unexpected
    with torch.no_grad():
        for name, module in quantized.items():
            local = {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + ".")}
            weight = compressor.decompress(local, module.quantization_scheme)["weight"]
            module.weight.data = weight.float()
            module.quantization_status = QuantizationStatus.COMPRESSED  # the weight is final; activations still quantize
    return model.eval()


# ---- NVIDIA Model Optimizer ----------------------------------------------------------------------------------


def moe_model() -> str:
    """A tiny Qwen3-MoE (8 experts, top 2, one dense MLP layer) for the quantized-experts checkpoints."""
    return _cached("qwen3-moe", lambda d: make_tiny_model("qwen3_moe", d))


def make_modelopt_fp8(legacy: bool = False, per_channel: bool = False, moe: bool = False) -> tuple[str, str]:
    """(checkpoint, reference) of Model Optimizer's FP8 export of the base model, made by ``nvidia-modelopt`` itself
    (static scales calibrated on random tokens, with KV-cache scales); the reference holds each float8 weight times its
    scale in float32. ``legacy``: the quantization stated only in ``hf_quant_config.json``, as older exports do;
    ``per_channel``: ``FP8_PER_CHANNEL_PER_TOKEN`` (a weight scale per row, dynamic activations, no KV scales);
    ``moe``: of ``moe_model()`` (each expert's projections in float8, the routers excluded)."""
    def make(dst_q: str, dst_ref: str) -> None:
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        src = moe_model() if moe else base_model()
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        calib = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
        config = mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG if per_channel else dict(
            mtq.FP8_DEFAULT_CFG, quant_cfg=[*mtq.FP8_DEFAULT_CFG["quant_cfg"], *mtq.FP8_KV_CFG["quant_cfg"]])
        model = mtq.quantize(model, config, lambda m: m(calib))
        export_hf_checkpoint(model, export_dir=dst_q)
        if legacy:
            with open(os.path.join(dst_q, "config.json")) as f:
                config = json.load(f)
            del config["quantization_config"]
            with open(os.path.join(dst_q, "config.json"), "w") as f:
                json.dump(config, f, indent=1)
        state = load_file(os.path.join(dst_q, "model.safetensors"))
        ref = {k: (v.float() * state[k + "_scale"].float().reshape(-1, 1) if v.dtype == torch.float8_e4m3fn else v.float())
               for k, v in state.items() if not k.endswith("_scale")}
        _write(dst_ref, ref, None, src)

    name = f"modelopt-fp8{'-moe' if moe else ''}{'-channel' if per_channel else '-kv'}{'-legacy' if legacy else ''}"
    return _pair(name, make)


def make_all() -> None:
    for name in CT_SCHEMES:
        print(make_ct(name))
    print(make_gptq(4, 128, False, True), make_awq(128), make_modelopt_fp8())


if __name__ == "__main__":
    make_all()
