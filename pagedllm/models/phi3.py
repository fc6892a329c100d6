"""Phi-3: the Llama decoder; its checkpoint already stores ``qkv_proj`` and ``gate_up_proj`` fused.

The fused tensors carry the names of our fused parameters, so they bypass the q/k/v and gate/up
mapping and are split by the layers' weight loaders (``shard_id=None``), which is also where a
tensor-parallel rank would take its slice. Rotary (incl. LongRoPE and ``partial_rotary_factor``)
and the optional ``sliding_window`` come from the config like for any Llama-family model.
"""
from __future__ import annotations

from typing import Any

from pagedllm.models.llama import DecoderOptions, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        return DecoderOptions()
