"""Applies a step's grammar bitmask to the sampled rows' logits: disallowed tokens become -inf.

It runs on the raw logits, before the sampler's processing (penalties, temperature, top-k/p): as in
vLLM, a masked token can never be drawn, and logprobs (computed by the sampler from the logits it is
given) report it as -inf. xgrammar's own kernels do the work: a CUDA/Triton one on the GPU, a C++ loop
on the CPU (``apply_token_bitmask_inplace`` picks by device).
"""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import torch
import xgrammar as xgr


class _Staging:
    """A pinned host buffer and a device buffer for the bitmask, kept across steps (grown when needed).

    The upload is asynchronous: a copy from pageable memory would make the host wait for the forward
    pass queued before it. Reusing the pinned buffer is safe because the runner waits for a step's
    sampled ids, which come after its bitmask copy on the stream, before it launches the next sampling.
    """

    def __init__(self) -> None:
        self.host: torch.Tensor | None = None
        self.device: torch.Tensor | None = None

    def upload(self, bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
        rows, width = bitmask.shape
        if self.host is None or self.host.shape[0] < rows or self.host.shape[1] != width or self.device.device != device:
            self.host = torch.empty((max(rows, 64), width), dtype=torch.int32, pin_memory=True)
            self.device = torch.empty((max(rows, 64), width), dtype=torch.int32, device=device)
        self.host[:rows].copy_(bitmask)
        self.device[:rows].copy_(self.host[:rows], non_blocking=True)
        return self.device[:rows]


_staging = _Staging()


def apply_grammar_bitmask(
    logits: torch.Tensor, row_req_ids: Sequence[str], grammar_rows: dict[str, int],
    bitmask: torch.Tensor | Future | None,
) -> None:
    """``logits`` [S, V] (row j is request ``row_req_ids[j]``); ``bitmask`` [R, ceil(V/32)] int32 on the host,
    whose row ``grammar_rows[req_id]`` holds that request's allowed tokens. In place; other rows untouched."""
    if bitmask is None or not grammar_rows:
        return
    if isinstance(bitmask, Future):  # filled in a thread while the forward pass ran
        bitmask = bitmask.result()
    targets, sources = [], []
    for j, rid in enumerate(row_req_ids):
        r = grammar_rows.get(rid)
        if r is not None:
            targets.append(j)
            sources.append(r)
    if not targets:
        return
    num_rows = logits.shape[0]
    if targets == sources and len(targets) == num_rows == bitmask.shape[0]:
        aligned = bitmask
    else:
        # xgrammar indexes the bitmask and the logits with the same row numbers; all bits set = no mask.
        aligned = torch.full((num_rows, bitmask.shape[1]), -1, dtype=torch.int32)
        aligned[targets] = bitmask[sources]
    if logits.device.type == "cpu":
        # The CPU kernel costs about 0.5 ms a row over a 262k vocabulary: only the constrained rows.
        xgr.apply_token_bitmask_inplace(logits, aligned, vocab_size=logits.shape[-1], indices=targets)
    else:
        # One launch over every row (an all-ones row changes nothing), with no index list to upload.
        xgr.apply_token_bitmask_inplace(logits, _staging.upload(aligned, logits.device), vocab_size=logits.shape[-1])
