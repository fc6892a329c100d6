"""Gemma 3 text decoder (``Gemma3ForCausalLM``, and the language model of ``Gemma3ForConditionalGeneration``).

Built from the Llama blocks with Gemma's switches: ``(1 + w)`` RMSNorms everywhere (four per layer:
around attention and around the MLP), per-head q/k norms, a gelu-tanh gated MLP, embeddings scaled
by sqrt(hidden_size), attention scale ``query_pre_attn_scalar ** -0.5``, sliding-window layers
interleaved with global ones (``config.layer_types``), each layer type with its own rotary base
(``rope_parameters["sliding_attention"]`` / ``["full_attention"]``), tied embeddings and optional
final logit soft-capping.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import ModelConfig
from pagedllm.layers.embedding import VocabEmbedding
from pagedllm.layers.norm import GemmaRMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, cos_sin_once_per_step, get_rope
from pagedllm.distributed.pipeline import IntermediateTensors
from pagedllm.models.llama import (
    LlamaAttention, LlamaForCausalLM, LlamaMLP, PipelineStage, PPMissingLayer, last_layer_only, layer_sliding_window,
)

# Checkpoint prefixes of a Gemma3ForConditionalGeneration (transformers 5 layout, then the older
# hub layout) -> the text model's names; the vision tower and projector are not served.
_MULTIMODAL_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_MULTIMODAL_SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


# Rows of one MLP call in a long CPU prefill (see Gemma3DecoderLayer._mlp_block).
_CPU_MLP_ROWS = 512


def _layer_types(hf_config: Any) -> list[str]:
    """Each layer's type; transformers fills ``layer_types`` from ``sliding_window_pattern`` when absent."""
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        window = getattr(hf_config, "sliding_window", None)
        types = ["sliding_attention" if window else "full_attention"] * hf_config.num_hidden_layers
    return list(types)


class Gemma3DecoderLayer(nn.Module):
    """Pre- and post-norms around both the attention and the MLP, on one running residual stream."""

    def __init__(
        self,
        hf_config: Any,
        layer_idx: int,
        head_size: int,
        rotary_emb: RotaryEmbedding,
        attn_backend: type[AttentionBackend],
    ) -> None:
        super().__init__()
        cfg = hf_config
        eps = cfg.rms_norm_eps
        bias = bool(getattr(cfg, "attention_bias", False))
        self.self_attn = LlamaAttention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_size,
            rotary_emb,
            attn_backend,
            scale=cfg.query_pre_attn_scalar**-0.5,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm_cls=GemmaRMSNorm,
            rms_norm_eps=eps,
            sliding_window=layer_sliding_window(cfg, layer_idx),
            # No attention soft cap: Gemma 3 replaced Gemma 2's with the q/k norms, and HF ignores
            # ``attn_logit_softcapping`` for Gemma 3 even when a config sets it.
            logits_soft_cap=None,
        )
        hidden_act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, hidden_act)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def quantized_input_producers(self) -> list[tuple[nn.Module, nn.Module]]:
        """(module, linear that alone consumes its output): where a float8 or int8 linear's input quantization fuses
        into the producer (``layers/quantization/fused_rows.py``)."""
        return [(self.input_layernorm, self.self_attn.qkv_proj), (self.pre_feedforward_layernorm, self.mlp.gate_up_proj),
                (self.mlp.act_fn, self.mlp.down_proj)]

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        hidden_states: torch.Tensor,  # [T, H]: the previous layer's normed MLP output (or the embeddings)
        residual: torch.Tensor | None,  # [T, H]: the residual stream before that output is added
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,  # [R] int64: carry only these rows past attention
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (normed MLP output [T, H], residual [T, H]); R rows with output_rows
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata, output_rows)
        if output_rows is not None:
            residual = residual.index_select(0, output_rows)
        # The post-norms apply to the branch output alone, before it joins the residual stream.
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self._mlp_block(hidden_states), residual

    def _mlp_block(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]: post-norm(MLP(x))
        num_tokens = x.shape[0]
        if x.is_cuda or num_tokens <= _CPU_MLP_ROWS:
            return self.post_feedforward_layernorm(self.mlp(x))
        # A long prefill on CPU: row tiles keep the [rows, 2 * intermediate] activations in cache and
        # their buffers in the allocator's reuse range; whole, they cost ~25% more (page faults, DRAM).
        out = torch.empty_like(x)
        for start in range(0, num_tokens, _CPU_MLP_ROWS):
            end = min(start + _CPU_MLP_ROWS, num_tokens)
            out[start:end] = self.post_feedforward_layernorm(self.mlp(x[start:end]))
        return out


class Gemma3Model(nn.Module):
    def __init__(self, model_config: ModelConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        cfg = model_config.hf_config
        head_size = model_config.head_size
        self.stage = stage = PipelineStage(cfg.num_hidden_layers)
        # Tied by default: the last stage keeps the table for its LM head.
        tied = bool(getattr(cfg, "tie_word_embeddings", True))
        embeds = stage.first or (stage.last and tied)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size) if embeds else PPMissingLayer()
        # float32 like HF's buffer; it is cast to the activations' dtype at use, as HF does (in bf16
        # sqrt(640) becomes 25.25), so half-precision embeddings round the same way.
        self.register_buffer(
            "embed_scale", torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32), persistent=False
        )
        layer_types = _layer_types(cfg)
        # One rotary module per layer type (local and global bases), shared by the layers of that type.
        self.rotary_embs = nn.ModuleDict(
            {lt: get_rope(cfg, head_size, model_config.max_model_len, layer_type=lt) for lt in sorted(set(layer_types))}
        )
        self.layers = stage.build_layers(
            cfg.num_hidden_layers,
            lambda i: Gemma3DecoderLayer(cfg, i, head_size, self.rotary_embs[layer_types[i]], attn_backend),
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if stage.last else PPMissingLayer()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,  # [R] int64 (see LlamaForCausalLM.forward)
        intermediate_tensors: IntermediateTensors | None = None,  # from the previous stage, unless first
    ) -> torch.Tensor | IntermediateTensors:  # [T, H], or [R, H] with output_rows; a stage not last: T rows
        stage = self.stage
        if stage.first:
            hidden_states = self.embed_tokens(input_ids)
            hidden_states = hidden_states * self.embed_scale.to(hidden_states.dtype)
            residual = None
        else:
            hidden_states, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        layers = self.layers[stage.start : stage.end]
        rows_per_layer = last_layer_only(output_rows if stage.last else None, len(layers))
        with cos_sin_once_per_step(self.rotary_embs.values(), positions):
            for layer, kv_cache, rows in zip(layers, kv_caches, rows_per_layer, strict=True):
                hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, attn_metadata, rows)
        if not stage.last:
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


def _text_model_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors under ``Gemma3ForCausalLM`` names, from a text or multimodal checkpoint."""
    for name, tensor in weights:
        if name.startswith(_MULTIMODAL_SKIPPED):
            continue
        for old, new in _MULTIMODAL_RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        yield name, tensor


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The Llama causal-LM shell around Gemma 3's decoder, tied by default, reading multimodal checkpoints too."""

    default_tie_word_embeddings = True

    def __init__(self, model_config: ModelConfig, attn_backend: type[AttentionBackend]) -> None:
        if getattr(model_config.hf_config, "use_bidirectional_attention", False):
            raise NotImplementedError("Gemma 3 with bidirectional attention (an embedding model) is not supported")
        super().__init__(model_config, attn_backend)

    def build_decoder(self, model_config: ModelConfig, attn_backend: type[AttentionBackend]) -> nn.Module:
        return Gemma3Model(model_config, attn_backend)

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        return _text_model_weights(weights)
