"""Top-k, top-p (nucleus) and min-p truncation of temperature-scaled logits, batched over rows with
different settings. Excluded tokens become -inf, so the sampler can draw from the logits directly."""
from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_top_k_only_(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """logits [R, V] (modified), top_k [R] int64 with V meaning disabled. Returns logits.

    A topk of the largest k any row needs is much cheaper than a full sort of the vocabulary.
    Tokens tied with the k-th value are kept, so a row may keep slightly more than k.
    """
    vocab_size = logits.shape[-1]
    top_vals = logits.topk(max_top_k, dim=-1).values  # [R, max_top_k], descending
    kth = top_vals.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))  # [R, 1]
    kth.masked_fill_((top_k >= vocab_size).unsqueeze(1), _NEG_INF)
    return logits.masked_fill_(logits < kth, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """logits [R, V], top_k [R] int64 (V = disabled) or None, top_p [R] float32 (1.0 = disabled).
    Returns new logits [R, V].

    Works on an ascending sort: top-k drops everything below the k-th largest value, then top-p drops
    the low tail whose total probability (after top-k) is at most 1 - p, always keeping the top token.
    """
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # [R, V]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab_size - top_k.clamp(1, vocab_size)).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    cum = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    drop = cum <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p_(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (modified), min_p [R] float32 (0 = disabled). Returns logits.

    p_i < min_p * p_max is the same test as logit_i < logit_max + log(min_p), which needs no softmax
    and is unaffected by earlier truncation (renormalising does not change probability ratios).
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill_(logits < threshold, _NEG_INF)


def truncate_candidates_(
    values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None, min_p: torch.Tensor | None
) -> torch.Tensor:
    """Top-k, top-p and min-p on a row's best candidates. values [R, K] float32, sorted descending
    (from topk; modified), top_k [R] int64 <= K, top_p / min_p [R] float32 or None. Returns values.

    The same rules as the [R, V] path: tokens below the k-th value go, then those whose better
    tokens already hold at least p of the probability, then those below min_p * p_max.
    """
    kth = values.gather(1, (top_k - 1).unsqueeze(1))
    values.masked_fill_(values < kth, _NEG_INF)
    if top_p is not None:
        probs = values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False
        values.masked_fill_(drop, _NEG_INF)
    if min_p is not None:
        values.masked_fill_(values < values[:, :1] + min_p.log().unsqueeze(1), _NEG_INF)
    return values
