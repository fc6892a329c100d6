"""Experts of a quantized checkpoint (AWQ, GPTQ, compressed-tensors W4A16/W8A16/W8A8, block-wise float8) held as
one quantized linear per expert and projection, in the checkpoint's own method.

Such checkpoints store every expert's projections like the dense linears (``experts.3.w1.qweight``,
``.qzeros``, ``.scales``; ``experts.3.gate_proj.weight_packed``, ...), so each local expert becomes a child
module named by its global id holding ``w1`` (gate) and ``w3`` (up), column-parallel over the intermediate
rows, and ``w2`` (down), row-parallel over them, each built with the linear method the checkpoint gives its
other linears. The loader places an expert tensor on ``experts.<id>.<shard id>.<suffix>`` (``models/weights.py``),
so the formats' own loaders, tensor-parallel slicing and processing (the W4A16 layout on CUDA, act-order
permutations) serve the experts as they serve the dense linears. An expert-parallel rank builds only its own
experts and the loader skips the others'.

On CUDA, 4/8-bit weight-only experts (AWQ, GPTQ, compressed-tensors W4A16/W8A16), block-wise float8 ones and
int8 W8A8 ones with symmetric weights (with a SiLU gate) are then stacked into a layout of the
grouped kernel (``wna16_layout.stack_experts``; float8 and int8 weights and their scales stacked as loaded) and
the per-expert linears freed: the forward is ``kernels.moe.fused_experts`` over them, a few launches a layer
whatever the routing, which CUDA graphs replay. Otherwise (the CPU; W8A8 experts with asymmetric weights) the forward is the
reference's per-expert loop (``reference.per_expert``): each expert's rows go through its three linears'
products and the gated activation, so the outputs are the dense format's, expert by expert. That loop reads how
many rows each expert got on the host, which a CUDA graph cannot replay: a model with such experts runs its
steps eagerly.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.fused_moe.reference import gated_activation, per_expert
from pagedllm.layers.linear import ColumnParallelLinear, LinearMethodBase, RowParallelLinear
from pagedllm.layers.quantization.wna16_layout import WNA16Weights, stack_experts


def takes_experts(method: LinearMethodBase | None) -> bool:
    """Whether a checkpoint's linear method also holds its experts, one linear per expert and projection."""
    return bool(getattr(method, "experts_as_linears", False))


class LinearExpertsMethod:
    """``MoEExperts``' experts as quantized linears (``layer.py``'s experts-method interface)."""

    cuda_graph_safe = False  # per_expert reads the rows per expert on the host; True once stacked (per layer)

    def __init__(self, factory) -> None:
        self.factory = factory  # () -> a fresh linear method of the checkpoint's kind

    def __repr__(self) -> str:
        return f"linears({type(self.factory()).__name__})"

    def create_weights(self, layer: nn.Module) -> None:
        h, i_total = layer.hidden_size, layer.intermediate_size_per_partition * layer.tp_size
        kw = dict(bias=False, params_dtype=layer.act_dtype, tp_rank=layer.tp_rank, tp_size=layer.tp_size)
        experts = []
        for e in range(layer.first_expert, layer.first_expert + layer.num_local_experts):
            expert = nn.Module()
            expert.w1 = ColumnParallelLinear(h, i_total, quant_method=self.factory(), **kw)
            expert.w3 = ColumnParallelLinear(h, i_total, quant_method=self.factory(), **kw)
            expert.w2 = RowParallelLinear(i_total, h, quant_method=self.factory(), reduce_results=False, **kw)
            layer.add_module(str(e), expert)
            experts.append(expert)
        layer.linear_experts = experts  # local index -> module; the layer sums over tensor ranks itself
        layer.w13_packed = layer.w2_packed = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """On CUDA, restacks the experts for the grouped kernel where their format allows (``stack_for_kernel``)."""
        experts = layer.linear_experts
        if experts and _on_cuda(experts[0].w1):
            self.stack_for_kernel(layer)

    def stack_for_kernel(self, layer: nn.Module) -> bool:
        """Stacks 4/8-bit weight-only experts (already in the kernel layout), block-wise float8 or int8 W8A8 ones
        with symmetric weights into the grouped kernel's tensors on ``layer``, then frees the per-expert linears; False where the experts' format or
        shapes do not allow it (they stay linears, run by the per-expert loop)."""
        experts = layer.linear_experts
        if not experts or layer.activation != "silu":
            return False
        linears = [(m.w1, m.w3, m.w2) for m in experts]
        if all(hasattr(p, "wna16") for ps in linears for p in ps):
            stack_into(layer, [[w1.wna16, w3.wna16] for w1, w3, _ in linears], [[w2.wna16] for _, _, w2 in linears])
        elif not (_stack_block_fp8(layer, linears) or _stack_int8(layer, linears)):
            return False
        for e in range(layer.first_expert, layer.first_expert + layer.num_local_experts):
            delattr(layer, str(e))
        layer.linear_experts = None
        self.cuda_graph_safe = True
        return True

    def apply(
        self,
        layer: nn.Module,
        hidden_states: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, K] float32
        topk_ids: torch.Tensor,  # [T, K] ids of this rank's experts
    ) -> torch.Tensor:  # [T, H]
        if layer.w13_packed is not None:
            from pagedllm.kernels.moe import fused_experts

            return fused_experts(hidden_states, layer.w13_packed, layer.w2_packed, topk_weights, topk_ids)

        def expert(x: torch.Tensor, e: int) -> torch.Tensor:  # [n, H] -> [n, H]
            m = layer.linear_experts[e]
            gate = m.w1.quant_method.apply(m.w1, x, None)  # [n, I / tp]
            up = m.w3.quant_method.apply(m.w3, x, None)
            h = gated_activation(torch.cat([gate, up], dim=-1), layer.activation)
            return m.w2.quant_method.apply(m.w2, h, None)  # this rank's partial sum

        return per_expert(hidden_states, topk_weights, topk_ids, layer.num_local_experts, expert)


def _on_cuda(linear: nn.Module) -> bool:
    if hasattr(linear, "wna16"):
        return linear.wna16.device.type == "cuda"
    return any(t.is_cuda for t in linear.parameters())


def _stack_block_fp8(layer: nn.Module, linears: list[tuple[nn.Module, nn.Module, nn.Module]]) -> bool:
    """Block-wise float8 experts as ``BlockFp8ExpertWeights`` on ``layer`` (``w13_packed``, ``w2_packed``): each
    expert's gate then up rows [2I, H] and down [H, I] in float8, with their block scales; False unless every
    projection is block float8 with activations quantized per block-deep group, and the gate rows end on a block."""
    from pagedllm.kernels import fp8_block
    from pagedllm.kernels.moe.grouped_gemm import BlockFp8ExpertWeights
    from pagedllm.layers.quantization.fp8_block import Fp8BlockLinearMethod

    methods = [p.quant_method for ps in linears for p in ps]
    if not all(isinstance(m, Fp8BlockLinearMethod) for m in methods):
        return False
    block, act_group = methods[0].block, methods[0].act_group
    probe = torch.empty(1, block[1], dtype=layer.act_dtype, device=linears[0][0].weight.device)
    if (any(m.block != block or m.act_group != act_group for m in methods) or act_group is None
            or not fp8_block.usable(probe, block, act_group) or layer.intermediate_size_per_partition % block[0]):
        return False
    scale = lambda p: getattr(p, p.quant_method.scale_name)  # noqa: E731
    layer.w13_packed = BlockFp8ExpertWeights(
        torch.stack([torch.cat([w1.weight, w3.weight]) for w1, w3, _ in linears]).contiguous(),
        torch.stack([torch.cat([scale(w1), scale(w3)]) for w1, w3, _ in linears]).float().contiguous(), block)
    layer.w2_packed = BlockFp8ExpertWeights(torch.stack([w2.weight for _, _, w2 in linears]).contiguous(),
                                            torch.stack([scale(w2) for _, _, w2 in linears]).float().contiguous(), block)
    for prefix, packed in (("w13", layer.w13_packed), ("w2", layer.w2_packed)):
        layer.register_buffer(f"{prefix}_weight", packed.weight)
        layer.register_buffer(f"{prefix}_weight_scale", packed.scale)
    return True


def _stack_int8(layer: nn.Module, linears: list[tuple[nn.Module, nn.Module, nn.Module]]) -> bool:
    """W8A8 experts with symmetric weights as ``Int8ExpertWeights`` on ``layer``: each expert's gate then up int8
    rows [2I, H] and down [H, I] with their row scales (and the rows' sums where the activations take a zero
    point per token); False unless every projection is W8A8 with symmetric weights and one activation scheme
    (asymmetric weights keep the per-expert loop, as their dense linears take the dequantized path)."""
    from pagedllm.kernels.moe.grouped_gemm import Int8ExpertWeights
    from pagedllm.layers.quantization.int8 import W8A8Int8LinearMethod

    methods = [p.quant_method for ps in linears for p in ps]
    if (not all(isinstance(m, W8A8Int8LinearMethod) and m.act is not None and m.weight_symmetric for m in methods)
            or len({m.act for m in methods}) != 1):
        return False
    make = Int8ExpertWeights if methods[0].act == "symmetric" else Int8ExpertWeights.asymmetric
    stack = lambda ps, name: torch.stack([torch.cat([getattr(p, name) for p in group]) for group in ps])  # noqa: E731
    w13, w2 = [(w1, w3) for w1, w3, _ in linears], [(w2,) for _, _, w2 in linears]
    layer.w13_packed = make(stack(w13, "weight").contiguous(), stack(w13, "weight_scale").flatten(1).float().contiguous())
    layer.w2_packed = make(stack(w2, "weight").contiguous(), stack(w2, "weight_scale").flatten(1).float().contiguous())
    for prefix, packed in (("w13", layer.w13_packed), ("w2", layer.w2_packed)):
        layer.register_buffer(f"{prefix}_weight", packed.weight)
        layer.register_buffer(f"{prefix}_weight_scale", packed.scale)
        if packed.row_sums is not None:
            layer.register_buffer(f"{prefix}_row_sums", packed.row_sums)
    return True


def stack_into(layer: nn.Module, w13: list[list[WNA16Weights]], w2: list[list[WNA16Weights]]) -> None:
    """The packed experts on ``layer`` (``w13_packed``, ``w2_packed``), their tensors registered as buffers."""
    layer.w13_packed, layer.w2_packed = stack_experts(w13), stack_experts(w2)
    for prefix, packed in (("w13", layer.w13_packed), ("w2", layer.w2_packed)):
        for name in ("qweight", "scales", "zeros", "g_idx"):
            if getattr(packed, name) is not None:
                layer.register_buffer(f"{prefix}_{name}", getattr(packed, name))
