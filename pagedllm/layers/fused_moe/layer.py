"""``MoEExperts``: a layer's experts as two stacked parameters, routed by the router's logits.

The experts' weights live in ``w13_weight`` [E, 2I, H] (each expert's gate rows, then its up rows) and
``w2_weight`` [E, H, I]; checkpoints that store one tensor per expert and projection are stacked into them
at load, through ``weight_loader`` with the expert id. On CUDA the Triton kernels of ``kernels/moe``
run the experts; elsewhere the per-expert reference does.

Under tensor parallelism each rank holds every expert's share of the intermediate rows (as the dense MLP's
gate/up and down split) and the partial outputs are summed over the group. Under expert parallelism
(``get_ep_group()`` of more than one rank) each rank holds whole experts, a contiguous range of them, and
tokens travel to them (``expert_parallel.py``); a rank reads only its own experts from the checkpoint. With
data parallelism the expert-parallel group spans every engine core's ranks, so each ``forward`` is a
collective of all of them: a core without tokens still calls it, with none (``run_moe_collectives``).

Float8 experts (``quantize_fp8``, run by ``--quantization fp8`` after loading) hold float8 e4m3 weights with
a float32 scale per expert and output row: ``w13_weight_scale`` [E, 2I], ``w2_weight_scale`` [E, H]. A float8
checkpoint (built under a serialized ``Fp8LinearMethod`` default) loads into that layout directly: each
expert's ``weight_scale`` (one a row, or one for the tensor, repeated over its rows) into its scale rows.

An experts method set while the model is built (``default_experts_method``; GGUF experts kept in their ggml
blocks on the CPU, ``gguf_experts.py``), or one a quantized checkpoint's format implies (one linear per expert
and projection, ``linear_experts.py``), holds the experts its own way: ``create_weights(layer)``, then
``apply(layer, x, topk_weights, topk_ids)`` for this rank's experts.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_ep_group, get_tp_group
from pagedllm.layers.fused_moe.expert_parallel import expert_parallel_experts
from pagedllm.layers.fused_moe.reference import fused_experts_ref
from pagedllm.layers.fused_moe.router import select_experts

def _serialized_fp8() -> bool:
    """Whether the model is being built for a float8 checkpoint (its linears default to stored float8)."""
    from pagedllm.layers.linear import current_default_method
    from pagedllm.layers.quantization.fp8 import Fp8LinearMethod

    method = current_default_method()
    return isinstance(method, Fp8LinearMethod) and method.serialized


def _checkpoint_experts_method():
    """Experts as one linear each of the checkpoint's method (``linear_experts.py``) when its linears are stored
    packed in a format kept per expert (AWQ, GPTQ, compressed-tensors, block-wise float8); else None."""
    from pagedllm.layers.fused_moe.linear_experts import LinearExpertsMethod, takes_experts
    from pagedllm.layers.linear import _DEFAULT_METHOD

    factory = _DEFAULT_METHOD.get()
    return LinearExpertsMethod(factory) if factory is not None and takes_experts(factory()) else None


# Checkpoint shard ids: w1 the gate projection, w3 the up projection, w2 the down projection.
SHARD_IDS = ("w1", "w2", "w3")

_EXPERTS_METHOD: ContextVar[Any] = ContextVar("pagedllm_experts_method", default=None)


@contextmanager
def default_experts_method(method: Any) -> Iterator[None]:
    """MoE layers built inside hold their experts through ``method`` (None: the stacked parameters)."""
    token = _EXPERTS_METHOD.set(method)
    try:
        yield
    finally:
        _EXPERTS_METHOD.reset(token)


class MoEExperts(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        activation: str = "silu",
        params_dtype: torch.dtype | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        self.ep_group = get_ep_group()
        self.tp_group = get_tp_group()
        if self.ep_group.world_size > 1:  # whole experts per rank: no split of their rows
            tp_rank, tp_size = 0, 1
        else:
            tp_rank = self.tp_group.rank_in_group if tp_rank is None else tp_rank
            tp_size = self.tp_group.world_size if tp_size is None else tp_size
        if num_experts < 1:
            raise ValueError(f"num_experts must be at least 1; got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}] (the number of experts); got {top_k}")
        if intermediate_size % tp_size:
            raise ValueError(f"moe intermediate size {intermediate_size} is not divisible by tensor parallel size "
                             f"{tp_size}")
        ep = self.ep_group.world_size
        if num_experts % ep:
            raise ValueError(f"the model's {num_experts} experts are not divisible by the {ep} expert-parallel ranks "
                             "(tensor_parallel_size, times data_parallel_size, with enable_expert_parallel)")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep
        self.first_expert = self.ep_group.rank_in_group * self.num_local_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size_per_partition = intermediate_size // tp_size
        self.renormalize = renormalize
        self.activation = activation
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.act_dtype = params_dtype or torch.get_default_dtype()  # the activations' type, which float8 experts keep
        self.experts_method = _EXPERTS_METHOD.get() or _checkpoint_experts_method()
        if self.experts_method is not None:
            self.experts_method.create_weights(self)
        else:
            self._create_params(self.num_local_experts, self.intermediate_size_per_partition, hidden_size)

    def _create_params(self, local: int, i: int, hidden_size: int) -> None:
        """The stacked experts in the model's dtype (float8 for a float8 checkpoint)."""
        dtype = self.act_dtype
        # Empty, not initialized: a checkpoint or the dummy loader overwrites them.
        self.w13_weight = nn.Parameter(torch.empty(local, 2 * i, hidden_size, dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(local, hidden_size, i, dtype=dtype), requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        # (shard id, expert id) pieces loaded so far: a checkpoint missing one expert must not pass as loaded.
        self._filled: dict[str, set[tuple[str, int]]] = {"w13": set(), "w2": set()}
        self.w13_weight_scale: torch.Tensor | None = None  # [E, 2I] float32 once float8
        self.w2_weight_scale: torch.Tensor | None = None  # [E, H] float32 once float8
        self.w13_weight.all_loaded = lambda: len(self._filled["w13"]) == 2 * local
        self.w2_weight.all_loaded = lambda: len(self._filled["w2"]) == local
        if _serialized_fp8():
            self._create_fp8_params(local, i, hidden_size)

    def _create_fp8_params(self, local: int, i: int, hidden: int) -> None:
        """Float8 weights and float32 scale rows that a float8 checkpoint fills as stored."""
        fp8 = torch.float8_e4m3fn
        for name, shape in (("w13_weight", (local, 2 * i, hidden)), ("w2_weight", (local, hidden, i))):
            key = name[:-len("_weight")]
            param = nn.Parameter(torch.empty(shape, dtype=fp8), requires_grad=False)
            param.weight_loader = self.weight_loader
            param.all_loaded = getattr(self, name).all_loaded
            setattr(self, name, param)
            scale = nn.Parameter(torch.empty(shape[:2], dtype=torch.float32), requires_grad=False)
            scale.weight_loader = self.weight_loader
            n_pieces = 2 * local if key == "w13" else local
            self._filled[key + "_scale"] = set()
            scale.all_loaded = lambda k=key + "_scale", n=n_pieces: len(self._filled[k]) == n
            setattr(self, name + "_scale", scale)

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded_weight: torch.Tensor,
        shard_id: str | None = None,
        expert_id: int | None = None,
    ) -> None:
        """One expert's projection (``shard_id`` w1/w3 into ``w13_weight``, w2 into ``w2_weight``), or, with
        neither id, every expert at once from a checkpoint that already stacks them."""
        if shard_id is None and expert_id is None:
            if loaded_weight.shape[0] != self.num_experts:
                raise ValueError(f"stacked expert weight of shape {tuple(loaded_weight.shape)} has "
                                 f"{loaded_weight.shape[0]} experts; the model has {self.num_experts}")
            for e in range(self.first_expert, self.first_expert + self.num_local_experts):
                self._load_whole_expert(param, loaded_weight[e], e)
            return
        local_id = self.local_expert(shard_id, expert_id)
        if local_id is None:
            return  # another expert-parallel rank's expert
        i = self.intermediate_size_per_partition
        if param is self.w13_weight_scale or param is self.w2_weight_scale:
            self._load_scale(param, loaded_weight, shard_id, expert_id, local_id)
            return
        if shard_id == "w2":
            dst = param.data[local_id]  # [H, I]
            src = loaded_weight.narrow(1, self.tp_rank * i, i) if self.tp_size > 1 else loaded_weight
        else:
            dst = param.data[local_id].narrow(0, 0 if shard_id == "w1" else i, i)  # [I, H]
            src = loaded_weight.narrow(0, self.tp_rank * i, i) if self.tp_size > 1 else loaded_weight
        if dst.shape != src.shape:
            raise ValueError(f"shape mismatch loading expert {expert_id} {shard_id}: parameter {tuple(dst.shape)}, "
                             f"checkpoint {tuple(src.shape)}")
        dst.copy_(src)
        self._filled["w2" if shard_id == "w2" else "w13"].add((shard_id, expert_id))

    def local_expert(self, shard_id: str | None, expert_id: int | None) -> int | None:
        """This rank's index of ``expert_id`` once both ids are checked; None for another expert-parallel rank's."""
        if shard_id not in SHARD_IDS:
            raise ValueError(f"expert shard id must be one of {', '.join(SHARD_IDS)}; got {shard_id!r}")
        if expert_id is None or not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id must be in [0, {self.num_experts}); got {expert_id!r}")
        local_id = expert_id - self.first_expert
        return local_id if 0 <= local_id < self.num_local_experts else None

    def _load_scale(
        self,
        param: nn.Parameter,  # [E, 2I] or [E, H] float32
        loaded: torch.Tensor,  # [N], [N, 1] or one value for the whole tensor
        shard_id: str,
        expert_id: int,
        local_id: int,
    ) -> None:
        """One expert projection's float8 scales: the down projection's rows are the hidden size (never split),
        the gate/up rows are split over tensor parallelism as their weights are."""
        i = self.intermediate_size_per_partition
        rows = self.hidden_size if shard_id == "w2" else i * self.tp_size
        loaded = loaded.float().reshape(-1)
        if loaded.numel() == 1:
            loaded = loaded.expand(rows)
        if loaded.numel() != rows:
            raise ValueError(f"expert {expert_id} {shard_id} weight_scale has {loaded.numel()} values; its "
                             f"projection has {rows} rows (one scale each, or one for the tensor)")
        if shard_id == "w2":
            param.data[local_id].copy_(loaded)
        else:
            src = loaded.narrow(0, self.tp_rank * i, i) if self.tp_size > 1 else loaded
            param.data[local_id].narrow(0, 0 if shard_id == "w1" else i, i).copy_(src)
        self._filled["w2_scale" if shard_id == "w2" else "w13_scale"].add((shard_id, expert_id))

    def _load_whole_expert(self, param: nn.Parameter, piece: torch.Tensor, expert_id: int) -> None:
        """One expert of a stacked checkpoint: [2I, H] gate then up, or [H, I]."""
        if param is self.w2_weight:
            self.weight_loader(param, piece, "w2", expert_id)
            return
        gate, up = piece.chunk(2, dim=0)
        self.weight_loader(param, gate, "w1", expert_id)
        self.weight_loader(param, up, "w3", expert_id)

    def quantize_fp8(self) -> None:
        """The loaded 16/32-bit experts to float8 rows with a float32 scale each, one expert at a time (the
        peak is the loaded layer plus one expert in float32)."""
        if self.w13_weight.dtype == torch.float8_e4m3fn:
            return
        from pagedllm.layers.quantization.fp8 import quantize_rows_ref

        for name in ("w13_weight", "w2_weight"):
            w = getattr(self, name).data  # [E, N, K]
            q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
            scales = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
            for e in range(w.shape[0]):
                q[e], s = quantize_rows_ref(w[e])
                scales[e] = s.reshape(-1)
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            setattr(self, name + "_scale", scales)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, H]
        router_logits: torch.Tensor,  # [T, E]
    ) -> torch.Tensor:  # [T, H]
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.ep_group.world_size > 1:
            # The tensor-parallel ranks hold the same tokens; other data-parallel cores' ranks hold their own.
            return expert_parallel_experts(hidden_states, topk_weights, topk_ids, self.ep_group,
                                           self.num_local_experts, self._local_experts, token_group=self.tp_group)
        out = self._local_experts(hidden_states, topk_weights, topk_ids)
        return self.tp_group.all_reduce(out) if self.tp_size > 1 else out

    def _local_experts(
        self,
        hidden_states: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, K] float32
        topk_ids: torch.Tensor,  # [T, K] ids of this rank's experts
    ) -> torch.Tensor:  # [T, H]
        if self.experts_method is not None:
            return self.experts_method.apply(self, hidden_states, topk_weights, topk_ids)
        if hidden_states.is_cuda:
            from pagedllm.kernels.moe import fused_experts, usable

            if usable(hidden_states, self.w13_weight, self.activation):
                return fused_experts(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                     w13_scale=self.w13_weight_scale, w2_scale=self.w2_weight_scale)
        return fused_experts_ref(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                 self.activation, self.w13_weight_scale, self.w2_weight_scale)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size_per_partition}, renormalize={self.renormalize}, "
                f"tp={self.tp_size}, experts_per_rank={self.num_local_experts}, "
                f"dtype={self.experts_method or self.w13_weight.dtype}")


@torch.inference_mode()
def run_moe_collectives(model: nn.Module) -> None:
    """Every expert-parallel MoE layer of ``model``, in order, over zero tokens: the part of a forward pass that
    the other data-parallel cores' ranks wait for, when this core has nothing to run (no attention, no KV)."""
    for layer in model.modules():
        if isinstance(layer, MoEExperts) and layer.ep_group.world_size > 1:
            device = next(itertools.chain(layer.parameters(), layer.buffers())).device
            hidden = torch.empty(0, layer.hidden_size, dtype=layer.act_dtype, device=device)
            layer(hidden, torch.empty(0, layer.num_experts, dtype=layer.act_dtype, device=device))
