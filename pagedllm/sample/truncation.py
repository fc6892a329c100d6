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
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor, max_top_k: int = 0
) -> torch.Tensor:
    """logits [R, V] (modified), top_k [R] int64 (V = disabled) or None, top_p [R] float32 (1.0 = disabled),
    max_top_k the largest enabled top_k (0: none). Returns logits.

    Top-k drops everything below the k-th largest value. Top-p then keeps, in decreasing order, each
    token whose better tokens hold less than p of the probability left after top-k (the top token
    always); tokens tied with the last one kept are kept too, so the result depends on values only,
    never on how a sort orders ties. Both become one threshold per row, applied in place.

    On CUDA a Triton kernel searches each row's thresholds in a few passes over it (top_p_triton.py);
    off CUDA they come from the best tokens of each row (a top-k selection, widened until it holds
    every row's boundary). A full sort of the vocabulary, the reference, is slower on both (1.8x on an
    H200 at 256 x 151,936, ~20x on a CPU).
    """
    vocab_size = logits.shape[-1]
    disabled = (top_p >= 1.0).unsqueeze(1)  # [R, 1]
    if logits.is_cuda:
        if logits.dtype == torch.float32 and logits.stride(-1) == 1:
            try:
                from pagedllm.kernels.sampling.top_p import top_k_top_p_triton_
            except ImportError:  # no Triton on this machine
                pass
            else:
                return top_k_top_p_triton_(logits, top_k, top_p)
        threshold = sorted_threshold_(logits, top_k, top_p)
    else:
        if top_k is not None and max_top_k > 0:
            apply_top_k_only_(logits, top_k, max_top_k)
        # Probabilities need the whole row's normaliser; the boundary needs only the best tokens.
        row_max = logits.amax(dim=-1, keepdim=True)  # [R, 1]
        norm = (logits - row_max).exp_().sum(dim=-1, keepdim=True)  # [R, 1]
        width = min(vocab_size, _CPU_TOP_P_WIDTH)
        while True:
            ranked = logits.topk(width, dim=-1).values  # [R, width], descending
            probs = (ranked - row_max).exp_().div_(norm)
            # Past a window holding p of the mass every token is dropped, so the window decides.
            if width == vocab_size or bool(((probs.sum(dim=-1, keepdim=True) >= top_p.unsqueeze(1)) | disabled).all()):
                break
            width = min(vocab_size, 4 * width)
        threshold = _top_p_threshold(ranked, probs, top_p)
    return logits.masked_fill_((logits < threshold) & ~disabled, _NEG_INF)


def sorted_threshold_(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """The top-k/top-p threshold of each row from a full sort: applies top-k to logits [R, V] (modified)
    and returns [R, 1] the smallest value top-p keeps. The CUDA path, and the CPU path's reference."""
    vocab_size = logits.shape[-1]
    ranked = logits.sort(dim=-1, descending=True).values  # [R, V]
    if top_k is not None:
        kth = ranked.gather(1, (top_k.clamp(1, vocab_size) - 1).unsqueeze(1))  # [R, 1]
        ranked.masked_fill_(ranked < kth, _NEG_INF)
        logits.masked_fill_(logits < kth, _NEG_INF)
    return _top_p_threshold(ranked, ranked.softmax(dim=-1), top_p)


# First width of the CPU top-p selection: real models' nuclei at usual settings fit in a few hundred.
_CPU_TOP_P_WIDTH = 1024


def _top_p_threshold(ranked: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """ranked [R, W] values in decreasing order and probs [R, W] their probabilities (holding each
    row's boundary) -> [R, 1] the smallest value top-p keeps."""
    mass_before = probs.cumsum(dim=-1) - probs
    kept = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)  # [R, 1]
    return ranked.gather(1, kept - 1)


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
    tokens already hold at least p of the probability (ties with the last kept one stay), then those
    below min_p * p_max.
    """
    kth = values.gather(1, (top_k - 1).unsqueeze(1))
    values.masked_fill_(values < kth, _NEG_INF)
    if top_p is not None:
        values.masked_fill_(values < _top_p_threshold(values, values.softmax(dim=-1), top_p), _NEG_INF)
    if min_p is not None:
        values.masked_fill_(values < values[:, :1] + min_p.log().unsqueeze(1), _NEG_INF)
    return values
