"""Mixtral: the Llama (Mistral) decoder with a sparse mixture of experts as every layer's feed-forward block.

The router's top-k weights are always renormalised to sum to one. Checkpoints name the block
``block_sparse_moe`` and the experts' projections ``w1`` (gate), ``w3`` (up) and ``w2`` (down).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.models.llama import DecoderOptions, LlamaDecoderLayer, MistralForCausalLM
from pagedllm.models.moe_block import SparseMoeBlock, rename_stacked_experts


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, hf_config: Any, layer_idx: int, options: DecoderOptions) -> nn.Module:
        cfg = hf_config
        return SparseMoeBlock(cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size,
                              cfg.hidden_act, renormalize=True)


class MixtralForCausalLM(MistralForCausalLM):
    decoder_layer_cls = MixtralDecoderLayer
    expert_params_mapping = {"w1": ("w13_weight", "w1"), "w3": ("w13_weight", "w3"), "w2": ("w2_weight", "w2")}

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        return rename_stacked_experts((name.replace(".block_sparse_moe.", ".mlp.", 1), t) for name, t in weights)
