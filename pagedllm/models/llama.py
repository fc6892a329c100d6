"""The Llama decoder (Llama 2/3/3.1, Vicuna, Mistral) and the building blocks its relatives reuse.

Qwen2, Qwen3 and Phi-3 are the same network with different switches (projection biases, per-head
q/k norms, fused checkpoints), so they subclass ``LlamaForCausalLM`` and override
``decoder_options``. Gemma-style models can reuse ``LlamaAttention`` (custom scale, q/k norm class,
per-layer rotary and sliding window, soft cap) and ``LlamaMLP`` (any gated activation).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import get_pp_group
from pagedllm.distributed.pipeline import IntermediateTensors, stage_layer_range
from pagedllm.layers.activation import get_act_and_mul
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import ParallelLMHead, VocabEmbedding
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, cos_sin_once_per_step, get_rope
from pagedllm.models.weights import load_named_weights


@dataclass(frozen=True)
class DecoderOptions:
    """The per-architecture switches of the shared decoder."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before rotary (Qwen3)


def layer_sliding_window(hf_config: Any, layer_idx: int) -> int | None:
    """The window of one layer: ``layer_types`` picks sliding layers when present, else all or none slide."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if window is not None and layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


def last_layer_only(output_rows: torch.Tensor | None, num_layers: int) -> list[torch.Tensor | None]:
    """Each layer's ``output_rows``: None for all but the last, which gets the caller's."""
    return [None] * (num_layers - 1) + [output_rows]


class PPMissingLayer(nn.Identity):
    """A module that another pipeline stage holds: no parameters here, and never called."""


class PipelineStage:
    """Which part of a decoder this process runs: layers [start, end), and whether it embeds the tokens
    (the first stage) or applies the final norm (the last)."""

    def __init__(self, num_layers: int) -> None:
        pp = get_pp_group()
        self.first, self.last = pp.is_first_rank, pp.is_last_rank
        self.start, self.end = stage_layer_range(num_layers, pp.rank_in_group, pp.world_size)

    def build_layers(self, num_layers: int, make) -> nn.ModuleList:
        """``make(i)`` for this stage's layers, a placeholder for the others (checkpoint names keep their index)."""
        return nn.ModuleList(make(i) if self.start <= i < self.end else PPMissingLayer() for i in range(num_layers))


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Checkpoint name prefixes of the modules other pipeline stages hold."""
    return tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, PPMissingLayer))


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.act_fn = get_act_and_mul(hidden_act)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        rotary_emb: RotaryEmbedding,
        attn_backend: type[AttentionBackend],
        scale: float | None = None,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_cls: type[RMSNorm] | None = None,
        rms_norm_eps: float = 1e-6,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.sliding_window = sliding_window
        self.qkv_proj = QKVParallelLinear(hidden_size, head_size, num_heads, num_kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_size, hidden_size, bias=o_bias)
        self.q_norm = qk_norm_cls(head_size, rms_norm_eps) if qk_norm_cls else None
        self.k_norm = qk_norm_cls(head_size, rms_norm_eps) if qk_norm_cls else None
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.qkv_proj.num_heads,
            head_size,
            scale if scale is not None else head_size**-0.5,
            self.qkv_proj.num_kv_heads,
            attn_backend,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        hidden_states: torch.Tensor,  # [T, H]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,  # [R] int64: project only these rows' outputs
    ) -> torch.Tensor:  # [T, H], or [R, H] with output_rows
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden_states))  # views of one [T, q + 2 kv] output
        out = self.attn(positions, q, k, v, kv_cache, attn_metadata, rotary=self.rotary_emb, q_norm=self.q_norm,
                        k_norm=self.k_norm)
        if output_rows is not None:
            out = out.index_select(0, output_rows)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        layer_idx: int,
        head_size: int,
        rotary_emb: RotaryEmbedding,
        attn_backend: type[AttentionBackend],
        options: DecoderOptions,
    ) -> None:
        super().__init__()
        cfg = hf_config
        eps = cfg.rms_norm_eps
        self.self_attn = LlamaAttention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_size,
            rotary_emb,
            attn_backend,
            qkv_bias=options.qkv_bias,
            o_bias=options.o_bias,
            qk_norm_cls=RMSNorm if options.qk_norm else None,
            rms_norm_eps=eps,
            sliding_window=layer_sliding_window(cfg, layer_idx),
        )
        self.mlp = self.make_mlp(cfg, layer_idx, options)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)

    def make_mlp(self, hf_config: Any, layer_idx: int, options: DecoderOptions) -> nn.Module:
        """The layer's feed-forward block, ``[T, H] -> [T, H]``; mixture-of-experts families return theirs."""
        return LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act, bias=options.mlp_bias)

    def quantized_input_producers(self) -> list[tuple[nn.Module, nn.Module]]:
        """(module, linear that alone consumes its output): where a float8 or int8 linear's input quantization fuses
        into the producer (``layers/quantization/fused_rows.py``)."""
        pairs = [(self.input_layernorm, self.self_attn.qkv_proj)]
        if isinstance(self.mlp, LlamaMLP):
            pairs += [(self.post_attention_layernorm, self.mlp.gate_up_proj), (self.mlp.act_fn, self.mlp.down_proj)]
        return pairs

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        hidden_states: torch.Tensor,  # [T, H]: the previous layer's MLP output (or the embeddings)
        residual: torch.Tensor | None,  # [T, H]: the residual stream before that output is added
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,  # [R] int64: carry only these rows past attention
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output [T, H], residual [T, H]); R rows with output_rows
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata, output_rows)
        if output_rows is not None:
            residual = residual.index_select(0, output_rows)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        model_config: ModelConfig,
        attn_backend: type[AttentionBackend],
        options: DecoderOptions,
        layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        cfg = model_config.hf_config
        self.stage = stage = PipelineStage(cfg.num_hidden_layers)
        # The last stage keeps the table too when the LM head shares it.
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        embeds = stage.first or (stage.last and tied)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size) if embeds else PPMissingLayer()
        self.rotary_emb = get_rope(cfg, model_config.head_size, model_config.max_model_len)
        self.layers = stage.build_layers(
            cfg.num_hidden_layers,
            lambda i: layer_cls(cfg, i, model_config.head_size, self.rotary_emb, attn_backend, options),
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if stage.last else PPMissingLayer()

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
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            hidden_states, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        layers = self.layers[stage.start : stage.end]
        rows_per_layer = last_layer_only(output_rows if stage.last else None, len(layers))
        # All layers share one rotary module.
        with cos_sin_once_per_step([self.rotary_emb], positions):
            for layer, kv_cache, rows in zip(layers, kv_caches, rows_per_layer, strict=True):
                hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, attn_metadata, rows)
        if not stage.last:
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # Checkpoint projections that live inside one fused parameter: (parameter, checkpoint name, shard).
    stacked_params_mapping: tuple[tuple[str, str, int | str], ...] = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )
    # Per-expert checkpoint projections -> (stacked parameter, shard id); mixture-of-experts families set it.
    expert_params_mapping: dict[str, tuple[str, str]] | None = None
    # The decoder layer; mixture-of-experts families swap its feed-forward block.
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    # Buffers some old checkpoints saved; they are recomputed from the config.
    ignored_weight_substrings: tuple[str, ...] = (
        "rotary_emb.inv_freq",
        "rotary_emb.cos_cached",
        "rotary_emb.sin_cached",
    )

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(hf_config, "mlp_bias", False)))

    # What a config without tie_word_embeddings means for this family.
    default_tie_word_embeddings = False

    def __init__(self, model_config: ModelConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        cfg = model_config.hf_config
        self.model_config = model_config
        self.model = self.build_decoder(model_config, attn_backend)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", self.default_tie_word_embeddings))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
            if self.tie_word_embeddings:
                self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.final_logit_softcapping = getattr(cfg, "final_logit_softcapping", None)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,  # [R] int64
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:  # [T, H], or [R, H] with output_rows
        """Final hidden states of every token, or only of ``output_rows`` (those whose logits are wanted).
        A pipeline stage other than the first continues from ``intermediate_tensors``; one other than the
        last returns its hidden states and residual stream for the next stage instead.

        With ``output_rows``, the last layer still computes attention, and so the KV cache, for every
        token, then runs its output projection and MLP on those rows alone: in a 1000-token prefill of a
        32-layer model that is ~3% of the step's products saved.
        """
        return self.model(input_ids, positions, kv_caches, attn_metadata, output_rows, intermediate_tensors)

    def compute_logits(
        self, hidden_states: torch.Tensor, float32: bool = True, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:  # [N, H] -> [N, vocab] float32 (see ParallelLMHead.compute_logits: float32, out, None)
        return self.lm_head.compute_logits(hidden_states, soft_cap=self.final_logit_softcapping, float32=float32,
                                           out=out)

    def sliding_windows(self) -> list[int | None]:
        """One entry per layer, for the KV cache manager: the layer's window, or None for full attention."""
        return [getattr(getattr(layer, "self_attn", None), "sliding_window", None) for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # A tied head has no weight of its own; some checkpoints still carry a copy of it.
        skip_prefixes = ("lm_head.",) if self.tie_word_embeddings else ()
        skip_prefixes += missing_prefixes(self)  # held by other pipeline stages
        return load_named_weights(
            self,
            self.checkpoint_weights(weights),
            self.stacked_params_mapping,
            skip_prefixes,
            self.ignored_weight_substrings,
            self.expert_params_mapping,
        )

    def build_decoder(self, model_config: ModelConfig, attn_backend: type[AttentionBackend]) -> nn.Module:
        return LlamaModel(model_config, attn_backend, self.decoder_options(model_config.hf_config),
                          self.decoder_layer_cls)

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """Renames checkpoint tensors to this class's layout where a family's checkpoints differ."""
        return weights


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding window on every layer when the config sets ``sliding_window``."""
