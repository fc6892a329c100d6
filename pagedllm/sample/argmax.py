"""Row-wise argmax over the vocabulary that stays parallel at any number of rows (Triton on CUDA, chunks in torch ops)."""
from __future__ import annotations

import torch

# Below this many rows torch's argmax reduces each row in one thread block: ~30 us for a 128k
# vocabulary on an H200, against a few us when the row is first cut into chunks reduced side by side.
_FEW_ROWS = 16
_CHUNKS = (256, 128, 64, 32, 16)


def argmax_rows(logits: torch.Tensor, chunked: bool | None = None) -> torch.Tensor:  # [S, V] -> [S] int64
    """``logits.argmax(dim=-1)``, ties to the first index (and NaN counting as the maximum) alike.

    On CUDA, by default, two Triton launches over (row, chunk) pairs (kernels/sampling/argmax.py). ``chunked``
    forces the two-stage form in torch ops on or off; without Triton it runs for a few rows on CUDA.
    """
    if chunked is None and logits.is_cuda:
        from pagedllm.kernels.sampling import argmax as argmax_triton

        if argmax_triton.usable(logits):
            return argmax_triton.argmax_rows_triton(logits)
    rows, vocab = logits.shape
    chunks = next((c for c in _CHUNKS if vocab % c == 0 and vocab >= 64 * c), None)
    if chunked is None:
        chunked = logits.is_cuda and rows < _FEW_ROWS
    if not chunked or chunks is None:
        return logits.argmax(dim=-1)
    width = vocab // chunks
    values, within = logits.view(rows, chunks, width).max(dim=-1)  # [S, C]: first maximum of each chunk
    best = values.argmax(dim=-1, keepdim=True)  # [S, 1]: the first chunk holding the row's maximum
    return (best * width + within.gather(1, best)).squeeze(1)
