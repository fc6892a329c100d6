"""Which sampled ids are real draws: a row whose logits are not finite, or whose every token is masked,
has no valid token, and no id it yields may reach the client or the next step's embedding lookup."""
from __future__ import annotations

import torch

# Sent to the host in place of the id of a row without a valid token.
INVALID_TOKEN_ID = -1


def check_sampled(logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] (as processed before the draw), token_ids [S] int64 -> (device ids [S], host ids [S]).

    A valid draw's processed logit is finite: masked tokens are -inf and never drawn while a finite one
    exists, and a NaN or infinite logit anywhere in a row wins every argmax (NaN counts as the maximum),
    so the chosen logit shows it. Device ids stay inside the vocabulary (the next step may read them
    before the host learns of the failure); host ids carry INVALID_TOKEN_ID for the failed rows.
    """
    vocab = logits.shape[-1]
    # CUDA's argmax kernels always return an index inside the row; the CPU's pruned Gumbel draw returns
    # the vocabulary size for a row it could not rank (NaN).
    in_range = token_ids if token_ids.is_cuda else token_ids.clamp(max=vocab - 1)
    ok = torch.isfinite(logits.gather(1, in_range.unsqueeze(1)).squeeze(1))
    if in_range is not token_ids:
        ok &= token_ids < vocab
    return in_range, torch.where(ok, in_range, INVALID_TOKEN_ID)
