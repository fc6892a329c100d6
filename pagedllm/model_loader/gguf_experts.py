"""GGUF mixture-of-experts files (llama.cpp's ``qwen2moe``, ``qwen3moe``, and ``llama`` with experts, i.e. Mixtral):
their config facts, their checks, and their stacked expert tensors cut into the HF checkpoint's per-expert tensors.

llama.cpp stacks a layer's experts into one tensor per projection, in torch order ``blk.N.ffn_gate_exps`` and
``ffn_up_exps`` [E, I, H] and ``ffn_down_exps`` [E, H, I], beside the router ``ffn_gate_inp`` [E, H]. Qwen2-MoE adds
a shared expert (``ffn_{gate,up,down}_shexp``, a dense MLP) and its sigmoid gate ``ffn_gate_inp_shexp`` ([H] from
converters that squeeze tensors, [1, H] from newer ones). Each stacked tensor is yielded here as one tensor per
expert, named as HF checkpoints name it (``mlp.experts.3.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.3.w1.weight``), so the models stack them into ``MoEExperts`` as they do from
safetensors. An expert-parallel rank decodes only its own experts' slices of the memory-mapped file.

Where the other matrices stay packed on the CPU (``quantization="gguf"``), so do the experts of a type the packed
kernel reads: each expert comes as its ggml type and packed rows (``...experts.3.gate_proj.qweight_type``,
``.qweight``) for ``layers/fused_moe/gguf_experts.py``; an expert of another type comes dequantized under the type
F32. Elsewhere (a GPU, whose MoE kernels read 16-bit or float8 experts, or ``gguf_dequantize``) the experts are
dequantized to the model's dtype at load. The routers are always read dense (the model keeps them in its dtype);
the shared expert is a dense MLP and takes the GGUF linears' path.
"""
from __future__ import annotations

import logging
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from pagedllm.layers.quantization.gguf_dequant import dequantize, type_name
from pagedllm.model_loader.gguf_reader import WITH_EXPERTS, field_value

_startup_log = logging.getLogger("pagedllm")


class _Family(NamedTuple):
    block: str  # the HF module that holds the router and the experts
    projections: tuple[str, str, str]  # an expert's gate, up and down projections as HF checkpoints name them
    shared_expert: bool


_FAMILIES = {
    "MixtralForCausalLM": _Family("block_sparse_moe", ("w1", "w3", "w2"), False),
    "Qwen2MoeForCausalLM": _Family("mlp", ("gate_proj", "up_proj", "down_proj"), True),
    "Qwen3MoeForCausalLM": _Family("mlp", ("gate_proj", "up_proj", "down_proj"), False),
}
_STACKED = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # gguf-py's FFN_{GATE,UP,DOWN}_EXP, in shard order
_ROUTERS = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight")
# llama.cpp's build_moe_ffn renormalises the top-k weights per architecture where the file does not say
# (``{arch}.expert_weights_norm``): Qwen3-MoE does, Qwen2-MoE does not; Mixtral always does, as our model does.
_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True}
_SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX, the only routing our MoE block runs


def is_moe(hf_arch: str) -> bool:
    return hf_arch in _FAMILIES


def moe_block_modules(hf_arch: str) -> tuple[str, ...]:
    """HF module names (within a layer) of the family's router and shared expert: dense tensors gguf-py's name
    table maps. The stacked experts are not among them (``expert_tensor_index``)."""
    family = _FAMILIES.get(hf_arch)
    if family is None:
        return ()
    shared = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
              "mlp.shared_expert_gate") if family.shared_expert else ()
    return (f"{family.block}.gate",) + shared


def is_router(gguf_name: str) -> bool:
    """A router or shared-expert gate: read dense in the model's dtype, never kept packed."""
    return gguf_name.endswith(_ROUTERS)


def router_weight(gguf_name: str, w: torch.Tensor) -> torch.Tensor:  # [E, H], or [H] / [1, H] -> [1, H]
    return w.reshape(1, -1) if gguf_name.endswith(".ffn_gate_inp_shexp.weight") else w


def _torch_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(reversed([int(n) for n in tensor.shape]))  # GGUF lists dims fastest-first


def _required(reader: Any, key: str) -> int:
    value = field_value(reader, key)
    if value is None:
        raise ValueError(f"GGUF mixture-of-experts file lacks the metadata key {key}")
    return int(value)


def _width(reader: Any, keys: tuple[str, ...], tensor_name: str) -> int:
    """A feed-forward width from the first metadata key present, else the rows of ``tensor_name`` (older files)."""
    for key in keys:
        if (value := field_value(reader, key)) is not None:
            return int(value)
    tensor = next((t for t in reader.tensors if t.name == tensor_name), None)
    if tensor is None:
        raise ValueError(f"GGUF mixture-of-experts file states none of {', '.join(keys)} and lacks {tensor_name}")
    return _torch_shape(tensor)[-2]


def expert_width(reader: Any, arch: str) -> int:
    """An expert's intermediate size I; Mixtral files (``llama``) state it as the feed-forward length."""
    keys = (f"{arch}.expert_feed_forward_length",) + ((f"{arch}.feed_forward_length",) if arch in WITH_EXPERTS else ())
    return _width(reader, keys, "blk.0.ffn_gate_exps.weight")


def _shared_width(reader: Any, arch: str) -> int:
    return _width(reader, (f"{arch}.expert_shared_feed_forward_length",), "blk.0.ffn_gate_shexp.weight")


def moe_config(reader: Any, arch: str, hf_arch: str, config: dict[str, Any]) -> None:
    """The HF config fields of a MoE file that transformers' GGUF table leaves out: the expert widths (its table has
    no ``expert_feed_forward_length``, so Qwen configs keep class defaults), Mixtral's experts (it reads such a file
    as dense llama), and top-k renormalisation, which llama.cpp fixes per architecture."""
    family = _FAMILIES.get(hf_arch)
    if family is None:
        return
    gating = field_value(reader, f"{arch}.expert_gating_func")
    if gating is not None and int(gating) != _SOFTMAX_GATING:
        raise ValueError(f"GGUF {arch}.expert_gating_func is {gating}; pagedllm routes experts by softmax "
                         f"({_SOFTMAX_GATING}) only")
    experts = _required(reader, f"{arch}.expert_count")
    used = _required(reader, f"{arch}.expert_used_count")
    width = expert_width(reader, arch)
    if hf_arch == "MixtralForCausalLM":
        config.update(num_local_experts=experts, num_experts_per_tok=used, intermediate_size=width)
        return
    norm = field_value(reader, f"{arch}.expert_weights_norm")
    # llama.cpp runs experts in every layer of these architectures: no dense layers in between.
    config.update(num_experts=experts, num_experts_per_tok=used, moe_intermediate_size=width, decoder_sparse_step=1,
                  mlp_only_layers=[], norm_topk_prob=_NORM_TOPK[arch] if norm is None else bool(norm))
    if family.shared_expert:
        config["shared_expert_intermediate_size"] = _shared_width(reader, arch)


def expert_tensor_index(reader: Any, arch: str, hf_arch: str, num_layers: int, path: str) -> dict[str, tuple[int, int]]:
    """GGUF name -> (layer, projection: 0 gate, 1 up, 2 down) of every stacked expert tensor, once every layer's
    experts, router and shared expert are found with the shapes the metadata implies; {} for a dense file."""
    family = _FAMILIES.get(hf_arch)
    if family is None:
        return {}
    tensors = {t.name: t for t in reader.tensors}
    e, h = _required(reader, f"{arch}.expert_count"), _required(reader, f"{arch}.embedding_length")
    i = expert_width(reader, arch)
    expected: dict[str, tuple[int, ...]] = {}
    for layer in range(num_layers):
        b = f"blk.{layer}."
        expected |= {b + "ffn_gate_inp.weight": (e, h), b + "ffn_gate_exps.weight": (e, i, h),
                     b + "ffn_up_exps.weight": (e, i, h), b + "ffn_down_exps.weight": (e, h, i)}
        if family.shared_expert:
            s = _shared_width(reader, arch)
            expected |= {b + "ffn_gate_inp_shexp.weight": (h,), b + "ffn_gate_shexp.weight": (s, h),
                         b + "ffn_up_shexp.weight": (s, h), b + "ffn_down_shexp.weight": (h, s)}
    for name, shape in expected.items():
        tensor = tensors.get(name)
        if tensor is None:
            old = " (it holds one tensor per expert, llama.cpp's layout before 2024: convert it again)" if (
                f"{name.rsplit('.', 2)[0]}.ffn_gate.0.weight" in tensors) else ""
            raise ValueError(f"GGUF {path} lacks {name}: every layer of this {arch} file with {e} experts needs its "
                             f"router, stacked experts{' and shared expert' if family.shared_expert else ''}{old}")
        got = _torch_shape(tensor)
        if got != shape and not (name.endswith("_inp_shexp.weight") and got == (1, h)):
            raise ValueError(f"GGUF {path} tensor {name} has shape {list(got)} (torch order); expected {list(shape)} "
                             f"from {arch}.expert_count {e}, embedding_length {h} and the expert width {i}")
    return {n: (int(n.split(".")[1]), _STACKED.index(n.split(".")[2])) for n in expected if n.split(".")[2] in _STACKED}


def iter_experts(
    tensor: Any, layer: int, projection: int, hf_arch: str, dtype: torch.dtype, device: torch.device | str,
    experts: range | None = None, keep_packed: Callable[[int], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked GGUF expert tensor [E, N, K] as ``(hf_name, [N, K] tensor in dtype)``, one per expert of ``experts``
    (all when None); only those experts' bytes are read from the mapping. With ``keep_packed`` (ggml type -> whether
    it stays packed) each expert comes as ``<proj>.qweight_type`` then ``<proj>.qweight``: its rows [N, row_bytes]
    uint8 where the type stays packed, else F32 and the rows dequantized [N, K] in dtype."""
    from pagedllm.layers.quantization.gguf import F32

    family = _FAMILIES[hf_arch]
    shape = _torch_shape(tensor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only mapping, only read
        raw = torch.from_numpy(tensor.data)  # [E, N, row_bytes] uint8 blocks, or [E, N, K] F32/F16 values
    stem = f"model.layers.{layer}.{family.block}.experts.{{}}.{family.projections[projection]}."
    qtype = int(tensor.tensor_type)
    packed = keep_packed is not None and keep_packed(qtype)
    for e in experts if experts is not None else range(shape[0]):
        module = stem.format(e)
        if packed:
            yield module + "qweight_type", torch.tensor(qtype)
            yield module + "qweight", raw[e].to(device)  # a view of the mapping: the layer copies it
            continue
        w = dequantize(raw[e].to(device), tensor.tensor_type, shape[1:], dtype)
        if keep_packed is None:
            yield module + "weight", w
        else:
            yield module + "qweight_type", torch.tensor(F32)
            yield module + "qweight", w


def local_experts(model: nn.Module) -> range | None:
    """The experts this rank holds when expert parallelism splits them (one range for every layer), else None."""
    from pagedllm.layers.fused_moe import MoEExperts

    for module in model.modules():
        if isinstance(module, MoEExperts) and module.num_local_experts < module.num_experts:
            return range(module.first_expert, module.first_expert + module.num_local_experts)
    return None


def log_experts(
    reader: Any, index: dict[str, tuple[int, int]], dtype: torch.dtype, experts: range | None,
    keep_packed: Callable[[int], bool] | None = None,
) -> None:
    """The start-up line of a MoE file: its stacked expert tensors by type, those kept packed (``keep_packed``, and
    the bytes this rank holds of them) and those dequantized, and the experts read."""
    if not index:
        return
    stacked = [t for t in reader.tensors if t.name in index]
    kept = [keep_packed is not None and keep_packed(int(t.tensor_type)) for t in stacked]
    packed = [t for t, k in zip(stacked, kept) if k]
    dense = [t for t, k in zip(stacked, kept) if not k]
    routers = sum(is_router(t.name) for t in reader.tensors)
    share = len(experts) / _torch_shape(stacked[0])[0] if experts else 1.0
    which = f"; this expert-parallel rank reads experts {experts.start}-{experts.stop - 1}" if experts else ""
    dtype_name = str(dtype).removeprefix("torch.")
    if not packed:
        why = ("no packed kernel for their types" if keep_packed
               else "experts stay packed only on the CPU under quantization gguf")
        _startup_log.info("gguf: %d stacked expert tensors (%s) and %d router tensors dequantized to %s at load (%s; "
                          "routers stay in the model's dtype)%s", len(index), _by_type(dense), routers, dtype_name,
                          why, which)
        return
    held = share * sum(int(t.n_bytes) for t in packed)
    size = f"{held / 2**30:.2f} GiB" if held >= 2**30 else f"{held / 2**20:.2f} MiB"
    also = (f", {len(dense)} dequantized to {dtype_name} ({_by_type(dense)}: no packed kernel for the type)"
            if dense else "")
    _startup_log.info("gguf: %d stacked expert tensors kept packed (%s; %s held)%s; %d router tensors dequantized to "
                      "%s (routers stay in the model's dtype)%s", len(packed), _by_type(packed), size, also, routers,
                      dtype_name, which)


def _by_type(tensors: list[Any]) -> str:
    return ", ".join(f"{k} x {v}" for k, v in Counter(type_name(t.tensor_type) for t in tensors).most_common())
