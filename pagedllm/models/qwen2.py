"""Qwen2 / Qwen2.5: the Llama decoder with biased q/k/v projections (and an unbiased o_proj)."""
from __future__ import annotations

from typing import Any

from pagedllm.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True, o_bias=False, mlp_bias=False)
