"""Token embedding and LM head, with the vocabulary split across tensor-parallel ranks and optional tied weights.

A quantized checkpoint that stores these tables its own way (GGUF) builds them under ``default_embedding_method``:
its method then owns the table (``create_weights``), decodes the rows tokens pick (``embedding``) and computes
the LM head's product (``apply``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers.cpu_linear import PackedWeight, cpu_linear


# The method of embedding tables built without one: set while a quantized checkpoint's model is built.
_DEFAULT_METHOD: ContextVar[Callable[[], Any] | None] = ContextVar("pagedllm_embedding_method", default=None)


@contextmanager
def default_embedding_method(factory: Callable[[], Any]) -> Iterator[None]:
    """Embeddings and LM heads constructed inside take ``factory()`` as their method."""
    token = _DEFAULT_METHOD.set(factory)
    try:
        yield
    finally:
        _DEFAULT_METHOD.reset(token)


class VocabEmbedding(nn.Module):
    """Embedding table whose rows (tokens) are split evenly over the tensor-parallel ranks (by default those
    of the current group); a vocabulary that does not divide is padded, the padding rows zero."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        group = get_tp_group()
        self.tp_group = group
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = group.rank_in_group if tp_rank is None else tp_rank
        self.tp_size = group.world_size if tp_size is None else tp_size
        tp_rank, tp_size = self.tp_rank, self.tp_size
        self.shard_size = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.shard_size
        self.vocab_end = max(min(self.vocab_start + self.shard_size, num_embeddings), self.vocab_start)
        self.params_dtype = dtype = params_dtype or torch.get_default_dtype()
        factory = _DEFAULT_METHOD.get()
        self.quant_method = factory() if factory is not None else None
        if self.quant_method is not None:
            self.quant_method.create_weights(self)
            return
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if loaded_weight.shape[0] != self.num_embeddings or loaded_weight.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"shape mismatch loading embedding: expected ({self.num_embeddings}, {self.embedding_dim}), "
                f"checkpoint {tuple(loaded_weight.shape)}"
            )
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded_weight[self.vocab_start : self.vocab_end])
        param.data[rows:].zero_()

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:  # [T] int64, rows of this shard -> [T, E]
        if self.quant_method is not None:
            return self.quant_method.embedding(self, ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, E]
        if self.tp_size == 1:
            return self._lookup(input_ids)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_shard, input_ids - self.vocab_start, 0)
        out = self._lookup(local_ids)
        out = out * in_shard.unsqueeze(-1).to(out.dtype)
        return self.tp_group.all_reduce(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}"


class ParallelLMHead(VocabEmbedding):
    """The output projection onto the vocabulary; may share its weight with the input embedding."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, tp_rank, tp_size)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.shard_size, dtype=self.params_dtype), requires_grad=False)
            self.bias.weight_loader = self._bias_loader
        else:
            self.register_parameter("bias", None)
        # The (possibly tied) weight in oneDNN's layout for CPU products, made on first use; a quantized
        # table's method keeps its own.
        self.packed_weight = PackedWeight() if self.quant_method is None else None

    def _bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded_weight[self.vocab_start : self.vocab_end])
        param.data[rows:].zero_()

    def tie_weights(self, embedding: VocabEmbedding) -> None:
        """Share the input embedding's table; the checkpoint then has no separate lm_head weight."""
        if self.quant_method is not None:
            self.quant_method.tie(self, embedding)
            return
        self.weight = embedding.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied through compute_logits, not called as an embedding")

    def compute_logits(
        self,
        hidden_states: torch.Tensor,  # [N, E]
        soft_cap: float | None = None,
        float32: bool = True,
        out: torch.Tensor | None = None,  # [>= N, shard] in the weight's dtype, on the weight's GPU
    ) -> torch.Tensor | None:  # [N, vocab] float32, or the weight's dtype when float32=False and no soft cap
        """Under tensor parallelism each rank computes its vocabulary shard's logits and they are gathered on
        the group's first rank, the one that samples; the others return None.
        ``float32=False`` skips the float32 copy when only an argmax follows: the conversion is exact,
        so the argmax (first maximum included) is the same; a soft cap is always applied in float32.
        ``out``: the product of N > 1 rows is written into its first N rows (one rank only), by the same
        cuBLAS call as ``F.linear``; the logits returned may then be a view of it."""
        if self.quant_method is not None:
            logits = self.quant_method.apply(self, hidden_states, self.bias)
        elif hidden_states.device.type == "cpu":
            logits = cpu_linear(hidden_states, self.weight, self.bias, self.packed_weight)
        else:
            logits = None
            if hidden_states.shape[0] == 1:
                from pagedllm.kernels import gemv  # one token: the batch-1 GEMV (linear.py)

                if gemv.usable(hidden_states, self.weight):
                    logits = gemv.gemv(hidden_states, self.weight, self.bias)
            if logits is None and out is not None and self.tp_size == 1 and hidden_states.shape[0] <= out.shape[0]:
                dst = out[: hidden_states.shape[0]]
                if self.bias is None:
                    logits = torch.mm(hidden_states, self.weight.t(), out=dst)
                else:
                    logits = torch.addmm(self.bias, hidden_states, self.weight.t(), out=dst)
            if logits is None:
                logits = F.linear(hidden_states, self.weight, self.bias)
        if self.tp_size > 1:
            logits = self.tp_group.gather(logits, dst=0, dim=-1)
            if logits is None:
                return None
        logits = logits[..., : self.num_embeddings]
        if not float32 and soft_cap is None:
            return logits
        logits = logits.float()
        if soft_cap is not None:
            logits = torch.tanh(logits / soft_cap) * soft_cap
        return logits
