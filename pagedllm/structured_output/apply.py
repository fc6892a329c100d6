"""Applies a step's grammar bitmask to the sampled rows' logits: disallowed tokens become -inf.

It runs on the raw logits, before the sampler's processing (penalties, temperature, top-k/p): as in
vLLM, a masked token can never be drawn, and logprobs (computed by the sampler from the logits it is
given) report it as -inf. xgrammar's own kernels do the work: a CUDA/Triton one on the GPU, a C++ loop
on the CPU (``apply_token_bitmask_inplace`` picks by device).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


def apply_grammar_bitmask(
    logits: torch.Tensor, row_req_ids: Sequence[str], grammar_rows: dict[str, int], bitmask: torch.Tensor | None
) -> None:
    """``logits`` [S, V] (row j is request ``row_req_ids[j]``); ``bitmask`` [R, ceil(V/32)] int32 whose
    row ``grammar_rows[req_id]`` holds that request's allowed tokens. In place; unconstrained rows untouched."""
    if bitmask is None or not grammar_rows:
        return
    targets, sources = [], []
    for j, rid in enumerate(row_req_ids):
        r = grammar_rows.get(rid)
        if r is not None:
            targets.append(j)
            sources.append(r)
    if not targets:
        return
    if targets == sources and len(targets) == logits.shape[0] == bitmask.shape[0]:
        aligned = bitmask
    else:
        # xgrammar indexes the bitmask and the logits with the same row numbers.
        aligned = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        aligned[targets] = bitmask[sources]
    if logits.device.type != "cpu":
        aligned = aligned.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, aligned, vocab_size=logits.shape[-1], indices=targets)
