"""Applies a step's grammar bitmask to the sampled rows' logits: disallowed tokens become -inf.

It runs on the raw logits, before the sampler's processing (penalties, temperature, top-k/p): as in
vLLM, a masked token can never be drawn, and logprobs (computed by the sampler from the logits it is
given) report it as -inf. On the GPU xgrammar's own kernel does the work. On the CPU its C++ loop took
0.5-1.3 ms a row over a 262,144-token vocabulary (a branch per token); numpy unpacks the bits and one
vectorized ``torch.where`` writes the row instead, with the same result.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np
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
        _mask_rows_on_cpu(logits, aligned, targets)
    else:
        # One launch over every row (an all-ones row changes nothing), with no index list to upload.
        xgr.apply_token_bitmask_inplace(logits, _staging.upload(aligned, logits.device), vocab_size=logits.shape[-1])


def _mask_rows_on_cpu(
    logits: torch.Tensor,  # [S, V]
    bitmask: torch.Tensor,  # [S, ceil(V / 32)] int32, row j for logits row j
    rows: list[int],  # the constrained rows; the others are left as they are
) -> None:
    """``xgr.apply_token_bitmask_inplace`` on the CPU, vectorized: token t of a row is allowed when bit t % 32 of
    its word t // 32 is set."""
    vocab = logits.shape[-1]
    if sys.byteorder != "little" or bitmask.shape[1] * 32 < vocab or not logits.is_contiguous():
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)  # raises if too narrow
        return
    every = len(rows) == logits.shape[0]
    words = (bitmask if every else bitmask[rows]).contiguous().numpy()
    # On a little-endian machine a word's bytes hold its bits 0-7, 8-15, ...: its tokens in order.
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    allowed = torch.from_numpy(bits).view(torch.bool)  # [rows, V]
    masked = torch.tensor(float("-inf"), dtype=logits.dtype)
    if every:
        torch.where(allowed, logits, masked, out=logits)
    else:
        index = torch.tensor(rows, dtype=torch.long)
        logits.index_copy_(0, index, torch.where(allowed, logits.index_select(0, index), masked))
