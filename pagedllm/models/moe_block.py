"""The sparse mixture-of-experts feed-forward block of Mixtral and Qwen-MoE: a router, the experts, and
optionally a shared expert behind a sigmoid gate (Qwen2-MoE)."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.layers.fused_moe import MoEExperts
from pagedllm.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
from pagedllm.models.llama import LlamaMLP

# Per-expert checkpoint projections of the HF Qwen-MoE layout -> (stacked parameter, shard id).
GATE_UP_DOWN_EXPERTS = {"gate_proj": ("w13_weight", "w1"), "up_proj": ("w13_weight", "w3"),
                        "down_proj": ("w2_weight", "w2")}
# Checkpoints that already stack the experts (transformers 5 saves ``experts.gate_up_proj`` [E, 2I, H]).
_STACKED_NAMES = ((".experts.gate_up_proj", ".experts.w13_weight"), (".experts.down_proj", ".experts.w2_weight"))


def _router_linear(hidden_size: int, outputs: int) -> ReplicatedLinear:
    # Routing decisions are discrete: the router stays in the model's dtype under any weight quantization.
    linear = ReplicatedLinear(hidden_size, outputs, bias=False, quant_method=UnquantizedLinearMethod())
    linear.keep_unquantized = True
    return linear


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        hidden_act: str,
        renormalize: bool,
        shared_expert_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act of a mixture-of-experts model must be 'silu'; got {hidden_act!r}")
        self.gate = _router_linear(hidden_size, num_experts)
        self.experts = MoEExperts(num_experts, top_k, hidden_size, intermediate_size, renormalize, activation="silu")
        if shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(hidden_size, shared_expert_intermediate_size, hidden_act)
            self.shared_expert_gate = _router_linear(hidden_size, 1)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        out = self.experts(hidden_states, self.gate(hidden_states))
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden_states)
            out = out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        return out


def rename_stacked_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """Tensors that hold every expert of a layer take the stacked parameters' names."""
    for name, tensor in weights:
        for old, new in _STACKED_NAMES:
            if name.endswith(old):
                name = name[: -len(old)] + new
                break
        yield name, tensor
