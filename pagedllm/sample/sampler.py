"""Sampler: turns one step's logits into next tokens (greedy or seeded random), plus raw logprobs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.sample.argmax import argmax_rows
from pagedllm.sample.logprobs import LogprobsTensors, gather_logprobs
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.penalties import needs_processing, process_logits_
from pagedllm.sample.rng import gumbel, gumbel_argmax
from pagedllm.sample.truncation import (
    apply_min_p_,
    apply_top_k_only_,
    apply_top_k_top_p,
    truncate_candidates_,
)
from pagedllm.sample.validity import check_sampled


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64, always inside the vocabulary
    logprobs: LogprobsTensors | None  # present when any request asked for logprobs (K = max asked)
    # [B] int64: sampled_token_ids, with INVALID_TOKEN_ID for rows that held no valid token (validity.py)
    checked_token_ids: torch.Tensor | None = None


class Sampler(torch.nn.Module):
    """Stateless: everything per request lives in SamplingMetadata, so one instance serves every step.

    Order: allowed_token_ids -> logit_bias -> min_tokens -> penalties -> greedy argmax, or for random
    rows temperature -> top-k -> top-p -> min-p -> Gumbel-max draw with counter-based noise.
    Logprobs are those of the raw logits, before any of this processing (vLLM's default).
    """

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] float32 (other float dtypes are upcast). The input is never modified."""
        md = metadata
        if logits.dim() != 2 or logits.shape != (md.num_reqs, md.vocab_size):
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match the metadata's "
                f"[{md.num_reqs}, {md.vocab_size}]"
            )
        raw = logits.to(torch.float32)
        logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(raw, dim=-1)
        owned = raw is not logits  # a fresh tensor we may modify in place
        if needs_processing(md):
            if not owned:
                raw, owned = raw.clone(), True
            process_logits_(raw, md)
        sampled, checked = check_sampled(raw, self._sample(raw, md, owned))
        if md.max_num_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs, checked_token_ids=checked)

    @staticmethod
    def _sample(logits: torch.Tensor, md: SamplingMetadata, owned: bool) -> torch.Tensor:
        """logits [B, V] processed -> [B] int64. Modifies logits only when owned is True."""
        if md.all_greedy:
            return argmax_rows(logits)
        if md.all_random:
            greedy = None
            rows = logits if owned else logits.clone()
            temperature, top_k, top_p, min_p = md.temperature, md.top_k, md.top_p, md.min_p
            key0, key1 = md.rng_key0, md.rng_key1
        else:
            greedy = argmax_rows(logits)
            idx = md.random_indices
            rows = logits.index_select(0, idx)  # a copy, free to modify
            temperature = md.temperature.index_select(0, idx)
            top_k = None if md.top_k is None else md.top_k.index_select(0, idx)
            top_p = None if md.top_p is None else md.top_p.index_select(0, idx)
            min_p = None if md.min_p is None else md.min_p.index_select(0, idx)
            key0, key1 = md.rng_key0.index_select(0, idx), md.rng_key1.index_select(0, idx)

        rows.div_(temperature.unsqueeze(1))
        # Gumbel-max: argmax(logits / T + G) is a draw from softmax(logits / T); -inf stays excluded.
        # The noise of a token depends only on its id and the row's keys, so drawing among the top-k
        # candidates picks the same token as drawing over the whole (truncated) vocabulary.
        if md.topk_candidates:
            values, ids = rows.topk(md.max_top_k, dim=-1)  # [R, K], descending
            truncate_candidates_(values, top_k, top_p, min_p)
            values += gumbel(key0, key1, ids)
            drawn = ids.gather(1, values.argmax(dim=-1, keepdim=True)).squeeze(1)
        else:
            if top_p is not None:
                apply_top_k_top_p(rows, top_k, top_p, md.max_top_k)
            elif top_k is not None:
                apply_top_k_only_(rows, top_k, md.max_top_k)
            if min_p is not None:
                apply_min_p_(rows, min_p)
            drawn = gumbel_argmax(rows, key0, key1)

        if greedy is None:
            return drawn
        return greedy.index_copy_(0, md.random_indices, drawn)
