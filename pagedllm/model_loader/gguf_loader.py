"""Loads GGUF checkpoints: the HF config and tokenizer from the metadata, and HF-named, dequantized weights.

Weights come out as the HF safetensors checkpoint of the same model would hold them, so the model
classes' ``load_weights`` take them unchanged: tensor names are mapped back with gguf-py's name
tables, and the two edits llama.cpp's converter makes are undone the way transformers undoes them:
the rotary row permutation of llama Q/K projections, and the ``+ 1`` folded into Gemma norm weights.
Mixture-of-experts files (stacked experts, routers, Qwen2-MoE's shared expert) are handled in ``gguf_experts.py``.
"""
from __future__ import annotations

import logging
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.layers.quantization.gguf_dequant import SUPPORTED_TYPES, dequantize, type_name
from pagedllm.model_loader import gguf_experts as moe
from pagedllm.model_loader.gguf_reader import (
    ARCHITECTURES, field_value, hf_architecture, open_gguf, supported_architectures,
)
from pagedllm.model_loader.base import BaseModelLoader, build_model, check_all_loaded, finalize_model

logger = logging.getLogger(__name__)
_startup_log = logging.getLogger("pagedllm")  # which path the weights took: one line per decision

# llama.cpp interleaves the rotary halves of these architectures' Q/K rows (its non-NeoX rope).
_QK_PERMUTED = frozenset({"llama"})
# llama.cpp stores these architectures' RMSNorm weights as ``1 + w`` (their norms scale by 1 + w).
_NORM_PLUS_ONE = frozenset({"gemma3"})
# GGUF tensors with no HF counterpart: llama 3's precomputed rope frequency factors.
_NO_HF_TENSOR = frozenset({"rope_freqs.weight"})

# HF module names of the llama-style decoders above; gguf-py's per-architecture table maps those that exist.
_HF_GLOBAL = ("model.embed_tokens", "model.norm", "lm_head")
_HF_BLOCK = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "self_attn.q_norm", "self_attn.k_norm",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
)


def _architecture(reader: Any, path: str | os.PathLike) -> str:
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF {path} has architecture {arch!r}; supported: {supported_architectures()}")
    return arch


def _config_beyond_transformers(reader: Any, arch: str, hf_arch: str, config: dict[str, Any]) -> None:
    """Facts llama.cpp reads or hardcodes that transformers' GGUF table leaves at class defaults.

    Each only applies when it differs from what transformers would pick, so for files where
    transformers is right (Gemma 3 270M included) the config stays equal to its.
    """
    # Qwen3 heads are not hidden/heads wide; transformers relies on Qwen3Config's default of 128.
    if arch == "qwen3" and (key_length := field_value(reader, "qwen3.attention.key_length")) is not None:
        config["head_dim"] = int(key_length)
    # Gemma 3 27B (62 layers) scales queries by hidden/heads, not head_dim (llama.cpp's f_attention_scale).
    if arch == "gemma3" and config.get("num_hidden_layers") == 62:
        config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"]
    scaling = field_value(reader, f"{arch}.rope.scaling.type")
    if scaling in ("linear", "yarn"):
        rope_scaling = {"rope_type": scaling, "factor": float(field_value(reader, f"{arch}.rope.scaling.factor"))}
        original = field_value(reader, f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            rope_scaling["original_max_position_embeddings"] = int(original)
        config["rope_scaling"] = rope_scaling  # the legacy key: config classes fold it into rope_parameters
    moe.moe_config(reader, arch, hf_arch, config)


def _items_skipped(field: Any) -> bool:
    """An array field read by ``open_gguf(skip_arrays=True)``: its length is known, its items are not."""
    from gguf import GGUFValueType

    return field.types[:1] == [GGUFValueType.ARRAY] and not field.data and int(field.parts[-1][0]) > 0


def gguf_hf_config(path: str | os.PathLike, reader: Any = None) -> Any:
    """The transformers ``PretrainedConfig`` the GGUF metadata describes, with ``architectures`` set.

    Uses transformers' own GGUF key table (``integrations.ggml.GGUF_CONFIG_MAPPING``) and the same
    derived fields as its ``load_gguf_checkpoint``, so for the files transformers reads right the
    result equals ``AutoConfig.from_pretrained(dir, gguf_file=...)``, in a fraction of the time (the
    vocabulary is only counted, not decoded). See ``_config_beyond_transformers`` for the rest.
    """
    from transformers import CONFIG_MAPPING
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    reader = reader if reader is not None else open_gguf(path, skip_arrays=True)
    arch = _architecture(reader, path)
    model_type, hf_arch = hf_architecture(reader, arch)
    config: dict[str, Any] = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type) or GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {})
    # transformers keys its table by HF model_type for the MoE files (qwen3_moe for qwen3moe keys).
    table = GGUF_CONFIG_MAPPING.get(arch) or GGUF_CONFIG_MAPPING[model_type]
    tables = {arch: table, "tokenizer": GGUF_CONFIG_MAPPING["tokenizer"]}
    for key, field in reader.fields.items():
        prefix, _, rest = key.partition(".")
        hf_key = tables.get(prefix, {}).get(rest)
        if hf_key is not None and hf_key != -1:
            if _items_skipped(field):  # an array the fast reader left unread: read the file in full
                return gguf_hf_config(path, open_gguf(path))
            config[hf_key] = field.contents()
    # llama.cpp writes an output projection only when it is not the tied embedding matrix.
    config["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    if "vocab_size" not in config:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"GGUF {path} states no vocab_size and has no tokenizer.ggml.tokens to count")
        config["vocab_size"] = int(tokens.parts[-1][0]) if _items_skipped(tokens) else len(tokens.data)
    _config_beyond_transformers(reader, arch, hf_arch, config)
    hf_config = CONFIG_MAPPING[model_type].from_dict(config)
    hf_config.architectures = [hf_arch]
    hf_config._name_or_path = os.fspath(path)
    return hf_config


def gguf_to_hf_names(arch: str, num_layers: int, hf_arch: str | None = None) -> dict[str, str]:
    """GGUF tensor name -> HF checkpoint name, e.g. ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.

    With a mixture-of-experts ``hf_arch`` the routers and shared expert too, named as that family names them
    (the stacked experts are not one-to-one: ``gguf_experts.expert_tensor_index``)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    (arch_id,) = [k for k, v in MODEL_ARCH_NAMES.items() if v == arch]
    table = get_tensor_name_map(arch_id, num_layers)
    block = _HF_BLOCK + (moe.moe_block_modules(hf_arch) if hf_arch else ())
    hf_modules = list(_HF_GLOBAL) + [f"model.layers.{i}.{m}" for i in range(num_layers) for m in block]
    names = {}
    for hf in hf_modules:
        gguf_name = table.get_name(hf)
        if gguf_name is not None:
            for suffix in (".weight", ".bias"):
                names[gguf_name + suffix] = hf + suffix
    return names


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row interleave of a Q or K projection (weight (heads*d, in) or bias (heads*d,)).

    llama.cpp stores each head's rows as pairs (r, r + d/2) side by side for its interleaved rope;
    HF's rotate_half wants the two halves apart. Same result as transformers' ``_reverse_permute_weights``.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_weights(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    reader: Any = None,
    keep_packed: Callable[[int], bool] | None = None,
    experts: range | None = None,
    pack_experts: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(hf_name, tensor)`` for every tensor of the file, dequantized to ``dtype`` on ``device``.

    Packed blocks are moved to ``device`` first, so a GPU decodes them. Tensors that need an edit
    are decoded to float32, edited, then cast, as transformers does.

    With ``keep_packed`` (ggml type -> whether it stays packed) every matrix comes as the GGUF layers take it
    (``layers/quantization/gguf.py``): ``<module>.qweight_type`` (its ggml type, or F32 for one dequantized
    here), then ``<module>.qweight`` (its packed rows [N, row_bytes] uint8, or the dequantized [N, K]).
    Q/K rows are un-permuted either way: the permutation moves whole rows.

    A mixture-of-experts file's stacked experts come one tensor per expert (``gguf_experts.py``), only those in
    ``experts`` (an expert-parallel rank's range) when given: dequantized, or with ``pack_experts`` as the matrices
    above (``<expert projection>.qweight_type`` then ``.qweight``, packed where ``keep_packed`` says); its routers
    come dense, never packed.
    """
    from pagedllm.layers.quantization.gguf import F32

    reader = reader if reader is not None else open_gguf(path, skip_arrays=True)
    arch = _architecture(reader, path)
    num_layers = int(field_value(reader, f"{arch}.block_count"))
    _, hf_arch = hf_architecture(reader, arch)
    names = gguf_to_hf_names(arch, num_layers, hf_arch)
    stacked = moe.expert_tensor_index(reader, arch, hf_arch, num_layers, os.fspath(path))
    unknown = [t.name for t in reader.tensors
               if t.name not in names and t.name not in stacked and t.name not in _NO_HF_TENSOR]
    if unknown:
        raise ValueError(f"GGUF {path} has tensors with no HF name for {arch}: {', '.join(unknown[:8])}")
    # Checked up front so an unsupported file fails before any weight is loaded.
    unsupported = sorted({type_name(t.tensor_type) for t in reader.tensors if t.tensor_type not in SUPPORTED_TYPES})
    if unsupported:
        raise NotImplementedError(f"GGUF {path} holds {', '.join(unsupported)} tensors, which cannot be dequantized yet")
    n_heads = int(field_value(reader, f"{arch}.attention.head_count"))
    n_kv_heads = int(field_value(reader, f"{arch}.attention.head_count_kv", n_heads))

    for tensor in reader.tensors:
        if tensor.name in _NO_HF_TENSOR:
            logger.warning("ignoring GGUF tensor %s: it has no HF checkpoint counterpart", tensor.name)
            continue
        if tensor.name in stacked:
            yield from moe.iter_experts(tensor, *stacked[tensor.name], hf_arch, dtype, device, experts,
                                        keep_packed if pack_experts else None)
            continue
        shape = tuple(reversed([int(n) for n in tensor.shape]))  # torch order (out, in); GGUF lists dims fastest-first
        with warnings.catch_warnings():
            # The mapping is read-only; the bytes are only read (dequantize never aliases its input).
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(tensor.data)  # (out, bytes per row) uint8 blocks, or (out, in) F32/F16 values
        base = tensor.name.rsplit(".", 1)[0]
        permuted = arch in _QK_PERMUTED and base.endswith((".attn_q", ".attn_k"))
        heads = n_heads if base.endswith(".attn_q") else n_kv_heads
        matrix = keep_packed is not None and len(shape) == 2 and not moe.is_router(tensor.name)
        if matrix and keep_packed(int(tensor.tensor_type)):
            rows = raw.reshape(shape[0], -1)  # [N, row_bytes] uint8
            module = names[tensor.name].rsplit(".", 1)[0]
            yield module + ".qweight_type", torch.tensor(int(tensor.tensor_type))
            yield module + ".qweight", (unpermute_qk(rows, heads) if permuted else rows).to(device)
            continue
        raw = raw.to(device)
        if permuted:
            w = dequantize(raw, tensor.tensor_type, shape)  # (heads * head_dim, hidden) f32
            w = unpermute_qk(w, heads).to(dtype)
        elif arch in _NORM_PLUS_ONE and tensor.name.endswith("norm.weight"):
            w = (dequantize(raw, tensor.tensor_type, shape) - 1.0).to(dtype)
        else:
            w = dequantize(raw, tensor.tensor_type, shape, dtype)
        if matrix:
            module = names[tensor.name].rsplit(".", 1)[0]
            yield module + ".qweight_type", torch.tensor(F32)
            yield module + ".qweight", w
        else:
            yield names[tensor.name], moe.router_weight(tensor.name, w)


def _dense_reason(model_config: ModelConfig, device: torch.device) -> str:
    from pagedllm.layers.quantization.gguf import packed_kernel_available

    if not packed_kernel_available(device):
        return f"no packed kernel on {device.type} here"
    if model_config.quantization is not None:
        return f"quantization {model_config.quantization} holds the dequantized weights its own way"
    return "gguf_dequantize"


def _packing_summary(
    reader: Any, dtype: torch.dtype, keep_packed: Callable[[int], bool], device: torch.device, pack_experts: bool
) -> None:
    """One log line per decision: the matrices kept packed by type, those dequantized and why, and weight bytes
    (stacked experts counted there, their types in the experts' line)."""
    from pagedllm.layers.quantization.gguf import packed_kernel_available

    packed: Counter[str] = Counter()
    dense: Counter[str] = Counter()
    held = as_float32 = 0
    for t in reader.tensors:
        if t.name in _NO_HF_TENSOR:
            continue
        n = int(t.n_elements)
        as_float32 += 4 * n
        if moe.is_router(t.name):  # counted in the experts' line
            held += n * dtype.itemsize
        elif len(t.shape) == 3:  # stacked experts, also in the experts' line
            held += int(t.n_bytes) if pack_experts and keep_packed(int(t.tensor_type)) else n * dtype.itemsize
        elif len(t.shape) == 2 and keep_packed(int(t.tensor_type)):
            packed[type_name(t.tensor_type)] += 1
            held += int(t.n_bytes)
        else:
            held += n * dtype.itemsize
            if len(t.shape) == 2:
                dense[type_name(t.tensor_type)] += 1
    by_type = ", ".join(f"{k} x {v}" for k, v in packed.most_common())
    _startup_log.info("gguf: %d tensors kept packed (%s), %d dequantized; weights %.2f GiB "
                      "(dense float32 would be %.2f GiB)",
                      sum(packed.values()), by_type or "none", sum(dense.values()), held / 2**30, as_float32 / 2**30)
    if dense:
        reason = ("no packed kernel for the type" if packed_kernel_available(device)
                  else f"no packed kernel on {device.type} here")
        for name, count in dense.most_common():
            _startup_log.info("gguf: %d %s tensors dequantized to %s (dense path: %s)", count, name,
                        str(dtype).removeprefix("torch."), reason)


def _log_experts(
    path: str, reader: Any, dtype: torch.dtype, experts: range | None, keep_packed: Callable[[int], bool] | None = None
) -> None:
    """A MoE file's line on its experts (checked first, so a malformed file fails before any weight loads)."""
    arch = _architecture(reader, path)
    _, hf_arch = hf_architecture(reader, arch)
    index = moe.expert_tensor_index(reader, arch, hf_arch, int(field_value(reader, f"{arch}.block_count")), path)
    moe.log_experts(reader, index, dtype, experts, keep_packed)


class GGUFModelLoader(BaseModelLoader):
    """``load_format="gguf"``: the model for ``hf_config`` filled from ``model_config.gguf_file`` (or ``.model``).

    Under ``quantization="gguf"`` matrices whose type the packed kernel reads stay in their blocks
    (``layers/quantization/gguf.py``; a MoE file's experts too on the CPU, ``layers/fused_moe/gguf_experts.py``)
    and nothing is cached: reading the file is the whole start. Otherwise
    every tensor is dequantized, and float32 loads keep a converted copy for later starts (``gguf_cache.py``).
    """

    def load_model(
        self, model_config: ModelConfig, device: torch.device, attn_backend: type[AttentionBackend]
    ) -> nn.Module:
        path = model_config.gguf_file or model_config.model
        if model_config.quantization == "gguf":
            return self._load_packed(path, model_config, device, attn_backend)
        from pagedllm.model_loader.gguf_cache import store_converted, tee_float32

        model = build_model(model_config, device, attn_backend)
        _startup_log.info("gguf: every tensor dequantized to %s (dense path: %s)",
                          str(model_config.dtype).removeprefix("torch."), _dense_reason(model_config, device))
        reader, experts = open_gguf(path, skip_arrays=True), moe.local_experts(model)
        _log_experts(path, reader, model_config.dtype, experts)
        weights = iter_gguf_weights(path, model_config.dtype, device, reader, experts=experts)
        # Float32 loads keep an exact copy for the converted cache: the next start reads safetensors
        # instead of parsing metadata and dequantizing again. Not an expert-parallel rank's: it lacks the
        # other ranks' experts.
        keep: dict[str, torch.Tensor] | None = {} if model_config.dtype == torch.float32 and experts is None else None
        if keep is not None:
            weights = tee_float32(weights, keep)
        loaded = model.load_weights(weights)
        check_all_loaded(model, loaded, path)
        if keep:
            store_converted(path, model_config.hf_config, keep)
        return finalize_model(model, device, model_config.quantization, model_config.cpu_int8_activations)

    def _load_packed(
        self, path: str, model_config: ModelConfig, device: torch.device, attn_backend: type[AttentionBackend]
    ) -> nn.Module:
        from pagedllm.layers.embedding import default_embedding_method
        from pagedllm.layers.fused_moe import gguf_experts
        from pagedllm.layers.fused_moe.layer import default_experts_method
        from pagedllm.layers.linear import default_linear_method
        from pagedllm.layers.quantization.gguf import GGUFConfig, finish_loading, keeps_packed

        config = GGUFConfig(int8_activations=model_config.cpu_int8_activations)
        # Experts stay packed on the CPU only: a GPU's MoE kernels read 16-bit or float8 experts.
        pack_experts = gguf_experts.packs_experts(device)
        experts_method = gguf_experts.GGUFExpertsMethod(config.int8_activations) if pack_experts else None
        with (default_linear_method(config.linear_method), default_embedding_method(config.embedding_method),
              default_experts_method(experts_method)):
            model = build_model(model_config, device, attn_backend)
        reader = open_gguf(path, skip_arrays=True)

        def keep_packed(qtype: int) -> bool:
            return keeps_packed(qtype, device)

        experts = moe.local_experts(model)
        _packing_summary(reader, model_config.dtype, keep_packed, device, pack_experts)
        _log_experts(path, reader, model_config.dtype, experts, keep_packed if pack_experts else None)
        weights = iter_gguf_weights(path, model_config.dtype, device, reader, keep_packed, experts, pack_experts)
        loaded = model.load_weights(weights)
        check_all_loaded(model, loaded, path)
        finish_loading(model)
        gguf_experts.finish_loading(model)
        if torch.device(device).type == "cpu":
            from pagedllm.kernels.cpu.hugepages import move_to_huge_pages

            # The products stream them every step.
            move_to_huge_pages(model, ("qweight_", "qweight_data") + gguf_experts.PACKED_BUFFERS)
        return finalize_model(model, device, None)
