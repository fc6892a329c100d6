"""A step's sampling for the model runner: the sampling metadata of its requests, the fallback that ends only
the requests whose own sampling raises when a batch's sampling does, and the prompt tokens' logprobs."""
from __future__ import annotations

import logging
from typing import Callable

import torch

from pagedllm.core.scheduler_output import LogprobsLists
from pagedllm.sample.validity import INVALID_TOKEN_ID
from pagedllm.worker.step_records import logprobs_to_lists

logger = logging.getLogger("pagedllm")


def sample_states(sampler, logits: torch.Tensor, states: list, device: torch.device):  # -> SamplerOutput
    """Samples logits [S, vocab] for the CachedRequestStates ``states``, in their order."""
    from pagedllm.sample.metadata import build_sampling_metadata

    # Penalties read every token id of the batch each step: hand them over as cached int64 arrays
    # (a copy each, not a conversion of every Python int).
    if any(st.sampling_params.has_penalties for st in states):
        ids = [st.token_arrays() for st in states]
    else:
        ids = [(st.prompt_token_ids, st.output_token_ids) for st in states]
    md = build_sampling_metadata(
        params=[st.sampling_params for st in states],
        prompt_token_ids=[p for p, _ in ids],
        output_token_ids=[o for _, o in ids],
        seeds=[st.seed for st in states],
        vocab_size=logits.shape[-1],
        device=device,
    )
    return sampler(logits, md)


def sample_isolating(sample: Callable, logits: torch.Tensor, states: list, device: torch.device) -> tuple:
    """``sample(logits, states)`` for logits [S, vocab]; if that raises, ends only the requests whose own
    sampling raises. Returns device ids [S] (inside the vocabulary), host-bound ids [S] (INVALID_TOKEN_ID
    where nothing was drawn), logprobs tensors or None, and {req_id: reason} of the failed requests."""
    try:
        out = sample(logits, states)
        return out.sampled_token_ids, out.checked_token_ids, out.logprobs, {}
    except Exception:  # noqa: BLE001 - find the culprit rows below; the rest of the batch goes on
        logger.exception("sampling a batch of %d requests failed; sampling each alone", len(states))
    errors: dict[str, str] = {}
    good: list[int] = []
    for j, st in enumerate(states):
        try:
            sample(logits[j : j + 1], [st])
            good.append(j)
        except Exception as e:  # noqa: BLE001 - this request alone is ended, with the reason
            logger.exception("sampling request %s failed", st.req_id)
            errors[st.req_id] = f"sampling failed ({type(e).__name__})"
    num = len(states)
    token_ids = torch.zeros(num, dtype=torch.int64, device=device)
    checked = torch.full((num,), INVALID_TOKEN_ID, dtype=torch.int64, device=device)
    lp = None
    if good:
        idx = torch.tensor(good, dtype=torch.int64, device=device)
        out = sample(logits.index_select(0, idx), [states[j] for j in good])
        token_ids.index_copy_(0, idx, out.sampled_token_ids)
        checked.index_copy_(0, idx, out.checked_token_ids)
        if out.logprobs is not None:
            # Full-height tensors so that rows keep their places; failed rows' entries are never read.
            lp = type(out.logprobs)(*(
                t.new_zeros((num, *t.shape[1:])).index_copy_(0, idx, t)
                for t in (out.logprobs.token_ids, out.logprobs.logprobs, out.logprobs.ranks)
            ))
    return token_ids, checked, lp, errors


def prompt_logprobs_of(
    b, hidden: torch.Tensor, requests: dict, model, device: torch.device  # b: BatchInputs; hidden [T, H]
) -> dict[str, LogprobsLists]:
    """Logprobs of each prompt token given its prefix, for the prompt positions in this step."""
    from pagedllm.sample.logprobs import compute_token_logprobs

    out: dict[str, LogprobsLists] = {}
    for i, rid in enumerate(b.req_ids):
        st = requests[rid]
        k = st.sampling_params.prompt_logprobs
        if k is None:
            continue
        start_tok, end_tok = int(b.query_start_loc[i]), int(b.query_start_loc[i + 1])
        start_pos = int(b.positions[start_tok])
        num_prompt = len(st.prompt_token_ids)
        # Hidden state at position p predicts prompt token p + 1.
        n = min(end_tok - start_tok, num_prompt - 1 - start_pos)
        if n <= 0:
            continue
        logits = model.compute_logits(hidden[start_tok : start_tok + n])
        if logits is None:  # another tensor rank samples and reports them
            continue
        targets = torch.tensor(st.prompt_token_ids[start_pos + 1 : start_pos + 1 + n], device=device)
        lp = compute_token_logprobs(logits, targets, k)
        rows = logprobs_to_lists(lp)
        out[rid] = LogprobsLists(
            [r.token_ids[0] for r in rows], [r.logprobs[0] for r in rows], [r.ranks[0] for r in rows]
        )
    return out
