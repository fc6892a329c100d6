"""Qwen2-MoE: the Qwen2 decoder whose sparse layers run a mixture of experts plus a shared expert.

A layer is sparse unless ``mlp_only_layers`` lists it, and only every ``decoder_sparse_step``-th layer
is; the others keep a dense MLP of ``intermediate_size``. The shared expert's output is scaled by a
sigmoid gate of the token and added to the routed experts' sum. ``norm_topk_prob`` says whether the
top-k weights are renormalised.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.models.llama import DecoderOptions, LlamaDecoderLayer, LlamaForCausalLM
from pagedllm.models.moe_block import GATE_UP_DOWN_EXPERTS, SparseMoeBlock, rename_stacked_experts


def is_sparse_layer(hf_config: Any, layer_idx: int) -> bool:
    """The Qwen-MoE rule: not in ``mlp_only_layers``, experts present, and on the ``decoder_sparse_step``."""
    num_experts = getattr(hf_config, "num_experts", 0) or 0
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(hf_config, "mlp_only_layers", None) or [])
            and num_experts > 0 and (layer_idx + 1) % step == 0)


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, hf_config: Any, layer_idx: int, options: DecoderOptions) -> nn.Module:
        cfg = hf_config
        if not is_sparse_layer(cfg, layer_idx):
            return super().make_mlp(cfg, layer_idx, options)
        return SparseMoeBlock(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.hidden_act,
            renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
            shared_expert_intermediate_size=getattr(cfg, "shared_expert_intermediate_size", 0) or 0,
        )


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen2MoeDecoderLayer
    expert_params_mapping = GATE_UP_DOWN_EXPERTS

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=bool(getattr(hf_config, "qkv_bias", True)), o_bias=False, mlp_bias=False)

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        return rename_stacked_experts(weights)
