"""Logit processing that precedes sampling: allowed-token masks, logit bias, min_tokens stop masking,
and repetition / frequency / presence penalties. All functions work in place on a [B, V] float32 tensor."""
from __future__ import annotations

import torch

from pagedllm.sample.metadata import SamplingMetadata


def needs_processing(md: SamplingMetadata) -> bool:
    """Whether any stage below would change the logits for this batch."""
    return (
        md.disallowed_mask is not None
        or md.bias_rows is not None
        or md.stop_rows is not None
        or not md.no_penalties
    )


def apply_penalties_(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """The reference: vLLM's penalties as dense [B, V] passes. logits [B, V] (modified), prompt_mask
    [B, V] bool or None, output_counts [B, V] int32, penalties [B] float32. Returns logits."""
    in_output = output_counts > 0
    if prompt_mask is not None:
        seen = in_output | prompt_mask
        # Repetition scales towards "less likely" whatever the sign: divide positive, multiply negative.
        rep = repetition.unsqueeze(1).expand_as(logits)
        scale = torch.where(logits > 0, rep.reciprocal(), rep)
        logits.mul_(torch.where(seen, scale, torch.ones_like(scale)))
    logits.sub_(frequency.unsqueeze(1) * output_counts.to(logits.dtype))
    logits.sub_(presence.unsqueeze(1) * in_output.to(logits.dtype))
    return logits


def apply_sparse_penalties_(
    logits: torch.Tensor,
    seen_index: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor | None,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """apply_penalties_ on the seen tokens only: logits [B, V] (modified), seen_index [N] int64
    row * V + token (an entry may repeat: repeats compute and write the same value), output_counts [N]
    float32, repetition (None: no prompt in seen_index) / frequency / presence [B] float32. The same
    float operations in the same order on every seen token, so the result equals the dense one; the
    unseen tokens, which the dense path leaves as they are, are not read. On CUDA one Triton launch
    (kernels/sampling/penalties.py; seen_index must then be ascending) instead of a dozen small ones."""
    if logits.is_cuda and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        try:
            from pagedllm.kernels.sampling.penalties import sparse_penalties_triton_
        except ImportError:  # no Triton on this machine
            pass
        else:
            return sparse_penalties_triton_(logits, seen_index, output_counts, repetition, frequency, presence)
    rows, cols = seen_index // logits.shape[1], seen_index % logits.shape[1]
    vals = logits[rows, cols]
    if repetition is not None:
        rep = repetition[rows]
        vals = vals * torch.where(vals > 0, rep.reciprocal(), rep)
    vals = vals - frequency[rows] * output_counts
    vals = vals - presence[rows] * (output_counts > 0).to(vals.dtype)
    logits[rows, cols] = vals
    return logits


def process_logits_(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Applies, in order: allowed_token_ids, logit_bias, min_tokens, penalties. logits [B, V] float32
    is modified in place and returned."""
    neg_inf = float("-inf")
    if md.disallowed_mask is not None:
        logits.masked_fill_(md.disallowed_mask, neg_inf)
    if md.bias_rows is not None:
        logits.index_put_((md.bias_rows, md.bias_cols), md.bias_values, accumulate=True)
    if md.stop_rows is not None:
        # A Python scalar: a device tensor made from it here would be a blocking host-to-device copy.
        logits[md.stop_rows, md.stop_cols] = neg_inf
    if md.no_penalties:
        return logits
    return apply_sparse_penalties_(
        logits,
        md.seen_index,
        md.seen_output_counts,
        md.repetition_penalties if md.repetition_seen else None,
        md.frequency_penalties,
        md.presence_penalties,
    )
