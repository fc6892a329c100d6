"""Qwen3: the Llama decoder with an RMSNorm over each head of q and k before rotary."""
from __future__ import annotations

from typing import Any

from pagedllm.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)
