"""GGUF experts kept in their ggml blocks on the CPU: the MoE experts method that holds each expert projection as
the file's packed rows and multiplies them through the packed kernel (``kernels/cpu/gguf_gemm.py``).

llama.cpp stacks a layer's experts into three tensors of one ggml type each (a Q4_K_M mix: gate and up Q4_K, down
Q4_K or Q6_K). The loader (``model_loader/gguf_experts.py``) yields them one expert at a time, as the dense GGUF
linears take theirs: ``experts.<e>.<proj>.qweight_type``, then ``.qweight``, its rows [N, row_bytes] uint8, or,
for a type the kernel does not read, its rows dequantized to the model's dtype under the type F32. An
expert-parallel rank keeps only its own experts; a tensor-parallel rank keeps its share of every expert's
intermediate rows (whole gate/up rows, and whole blocks of each down row). ``process_weights_after_loading``
then lays each layer out as

- ``w13_qweight`` [E_local, 2I, row_bytes(H)] uint8, each expert's gate rows then its up rows, when gate and up
  share one type, as llama.cpp's mixes give them; otherwise ``w1_qweight`` and ``w3_qweight`` apart (two
  products an expert instead of a layer dequantized);
- ``w2_qweight`` [E_local, H, row_bytes(I)] uint8,

with their types in ``gguf_w13`` and ``gguf_w2`` (an F32 projection holds [E_local, N, K] in the model's dtype).

The forward is the reference's per-expert loop (``reference.per_expert``) with each product through ``gguf_mm`` on
float32 rows cast back to the activations' dtype, as the dense GGUF linears do: the outputs are the dequantized
experts' up to float32 rounding of the products.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu import gguf_gemm
from pagedllm.layers.fused_moe.reference import gated_activation, per_expert
from pagedllm.layers.quantization.gguf import F32, gguf_type_name, input_slice, row_bytes

# Where packed experts live after loading: the loader moves these into the huge-page arena with the linears'.
PACKED_BUFFERS = ("w13_qweight", "w1_qweight", "w3_qweight", "w2_qweight")
_SHARDS = {"w13": ("w1", "w3"), "w2": ("w2",)}  # placeholder parameter -> the checkpoint shards it receives


def packs_experts(device: torch.device | str) -> bool:
    """Whether a GGUF file's experts may stay packed on ``device``: the CPU with the compiled kernel. A GPU's MoE
    kernels read 16-bit or float8 experts, so there (as without the kernel) they are dequantized at load."""
    return torch.device(device).type == "cpu" and gguf_gemm.available()


class GGUFExpertsMethod:
    """``MoEExperts``' experts as GGUF blocks (``layer.py``'s experts-method interface)."""

    def __init__(self, int8_activations: bool = False) -> None:
        self.int8_activations = int8_activations  # decode-sized steps quantize activations (gguf_gemm.gguf_mm)

    def __repr__(self) -> str:
        return "gguf"

    def create_weights(self, layer: nn.Module) -> None:
        """Empty ``w13_qweight_type``/``w13_qweight``/``w2_...`` parameters that only receive the file's pieces;
        each counts as loaded once every local expert's shards have arrived (``process_weights_after_loading``
        replaces them)."""
        layer.gguf_types = {}  # shard id -> ggml type: one per stacked tensor
        layer.gguf_rows = {}  # shard id -> [E_local, N, width], filled expert by expert
        layer.gguf_seen = {"type": set(), "rows": set()}  # (shard id, expert id) pieces arrived
        local = layer.num_local_experts
        for key, shards in _SHARDS.items():
            for suffix, loader, seen in (("_qweight_type", self._load_type, layer.gguf_seen["type"]),
                                         ("_qweight", self._load_rows, layer.gguf_seen["rows"])):
                param = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
                param.weight_loader = functools.partial(loader, layer)
                param.all_loaded = lambda seen=seen, shards=shards: (
                    sum(s in shards for s, _ in seen) == len(shards) * local)
                setattr(layer, key + suffix, param)

    def _load_type(
        self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None,
        expert_id: int | None = None,
    ) -> None:  # loaded: a 0-dim integer tensor, the ggml type
        if layer.local_expert(shard_id, expert_id) is None:
            return  # another expert-parallel rank's expert
        qtype = int(loaded)
        if layer.gguf_types.setdefault(shard_id, qtype) != qtype:
            raise ValueError(f"gguf: expert {expert_id} {shard_id} has type {gguf_type_name(qtype)}; the layer's "
                             f"other experts of that projection have {gguf_type_name(layer.gguf_types[shard_id])}")
        layer.gguf_seen["type"].add((shard_id, expert_id))

    def _load_rows(
        self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None,
        expert_id: int | None = None,
    ) -> None:  # loaded: one expert's [N, row_bytes] uint8, or [N, K] dequantized (F32)
        local_id = layer.local_expert(shard_id, expert_id)
        if local_id is None:
            return
        qtype = layer.gguf_types.get(shard_id)
        if qtype is None:
            raise ValueError(f"gguf: rows of expert {expert_id} {shard_id} arrived before its qweight_type")
        src = _rank_rows(layer, loaded, shard_id, qtype)
        rows = layer.gguf_rows.get(shard_id)
        if rows is None:
            dtype = layer.act_dtype if qtype == F32 else torch.uint8
            rows = layer.gguf_rows[shard_id] = torch.empty(layer.num_local_experts, *src.shape, dtype=dtype,
                                                           device=src.device)
        rows[local_id].copy_(src)
        layer.gguf_seen["rows"].add((shard_id, expert_id))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The placeholders replaced by the stacked buffers the forward reads."""
        if not hasattr(layer, "gguf_rows"):
            return  # already laid out
        rows, types = layer.gguf_rows, layer.gguf_types
        for key in _SHARDS:
            delattr(layer, key + "_qweight_type")
            delattr(layer, key + "_qweight")
        del layer.gguf_rows, layer.gguf_types, layer.gguf_seen
        if types["w1"] == types["w3"]:
            layer.register_buffer("w13_qweight", torch.cat([rows.pop("w1"), rows.pop("w3")], dim=1))
            layer.gguf_w13 = (("w13_qweight", types["w1"]),)
        else:
            layer.register_buffer("w1_qweight", rows.pop("w1"))
            layer.register_buffer("w3_qweight", rows.pop("w3"))
            layer.gguf_w13 = (("w1_qweight", types["w1"]), ("w3_qweight", types["w3"]))
        layer.register_buffer("w2_qweight", rows.pop("w2"))
        layer.gguf_w2 = ("w2_qweight", types["w2"])

    def apply(
        self,
        layer: nn.Module,
        hidden_states: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, K] float32
        topk_ids: torch.Tensor,  # [T, K] ids of this rank's experts
    ) -> torch.Tensor:  # [T, H]
        # A decode-sized step takes 8-bit activations, as the step's dense GGUF linears do (gguf_mm's row limit);
        # one expert's share of a prompt's rows stays float32 like the prompt's other products.
        int8 = self.int8_activations and hidden_states.shape[0] <= gguf_gemm.Q8_MAX_ROWS
        w13 = [(getattr(layer, name), qtype) for name, qtype in layer.gguf_w13]
        w2, w2_type = getattr(layer, layer.gguf_w2[0]), layer.gguf_w2[1]

        def expert(x: torch.Tensor, e: int) -> torch.Tensor:  # [n, H] -> [n, H]
            parts = [_product(x, w[e], qtype, int8) for w, qtype in w13]  # [n, 2I], or gate and up [n, I]
            h = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
            return _product(gated_activation(h, layer.activation), w2[e], w2_type, int8)

        return per_expert(hidden_states, topk_weights, topk_ids, layer.num_local_experts, expert)


def _rank_rows(layer: nn.Module, loaded: torch.Tensor, shard_id: str, qtype: int) -> torch.Tensor:
    """One expert's projection as the file holds it, checked, cut to this tensor-parallel rank's share."""
    i, tp = layer.intermediate_size_per_partition, layer.tp_size
    n, k = (layer.hidden_size, i * tp) if shard_id == "w2" else (i * tp, layer.hidden_size)
    width = k if qtype == F32 else row_bytes(qtype, k)
    if tuple(loaded.shape) != (n, width):
        raise ValueError(f"gguf: expert {shard_id} of type {gguf_type_name(qtype)} has shape {tuple(loaded.shape)}; "
                         f"the layer takes ({n}, {width}) for {k} inputs")
    if tp == 1:
        return loaded
    if shard_id != "w2":
        return loaded.narrow(0, layer.tp_rank * i, i)  # whole rows
    block = 1 if qtype == F32 else gguf_gemm.BLOCKS[qtype][0]
    if i % block:
        raise ValueError(f"gguf: tensor parallelism would split each expert's down projection at {i} of its {k} "
                         f"inputs, inside {gguf_type_name(qtype)}'s {block}-input blocks; use --enable-expert-parallel "
                         f"(whole experts per rank), a tensor parallel size that leaves each rank a multiple of "
                         f"{block} inputs, or --gguf-dequantize")
    return input_slice(loaded, qtype, i, layer.tp_rank, k)


def _product(
    x: torch.Tensor,  # [n, K]
    w: torch.Tensor,  # [N, row_bytes] uint8 blocks of qtype, or [N, K] (F32)
    qtype: int,
    int8_activations: bool,
) -> torch.Tensor:  # [n, N] in x's dtype
    if qtype == F32:
        return F.linear(x, w)  # the reference's product
    return gguf_gemm.gguf_mm(x.float(), w, qtype, int8_activations).to(x.dtype)


def finish_loading(model: nn.Module) -> None:
    """Lays out every GGUF experts layer's loaded pieces."""
    for module in model.modules():
        method = getattr(module, "experts_method", None)
        if isinstance(method, GGUFExpertsMethod):
            method.process_weights_after_loading(module)
