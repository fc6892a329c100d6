"""Qwen3-MoE: the Qwen3 decoder (per-head q/k norms) with Qwen2-MoE's sparse layers, without a shared expert."""
from __future__ import annotations

from typing import Any

from pagedllm.models.llama import DecoderOptions
from pagedllm.models.qwen2_moe import Qwen2MoeForCausalLM


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)
