"""Logprob tensors for sampled and prompt tokens: the chosen token's raw logprob and rank, plus the top-k."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogprobsTensors:
    """Per-position logprobs, still on the device; the engine turns them into Logprob dicts."""

    token_ids: torch.Tensor  # [N, K+1] int64; column 0 is the sampled (or actual next) token
    logprobs: torch.Tensor  # [N, K+1] float32, matching token_ids
    ranks: torch.Tensor  # [N] int64, 1-based rank of the column-0 token

    def to_lists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """One host copy of everything, for building the user-facing dicts without per-item syncs."""
        return self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """logprobs: [N, V] float32 (already normalised), token_ids: [N] int64, num_top = K >= 0."""
    token_ids = token_ids.to(torch.int64)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    # Rank counts strictly better tokens, so ties share the better rank.
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num_top > 0:
        top_vals, top_ids = logprobs.topk(num_top, dim=-1)
        ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1)
        vals = torch.cat([chosen, top_vals], dim=1)
    else:
        ids, vals = token_ids.unsqueeze(1), chosen
    return LogprobsTensors(token_ids=ids, logprobs=vals.to(torch.float32), ranks=ranks.to(torch.int64))


def compute_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Raw logprobs of given tokens. logits: [N, V], token_ids: [N] -> LogprobsTensors with K = num_top.

    Used for prompt logprobs, where token_ids[i] is the prompt token that follows position i.
    """
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return gather_logprobs(logprobs, token_ids, num_top)
