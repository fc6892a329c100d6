"""Triton kernel for penalties.apply_sparse_penalties_: all seen (row, token) entries penalised in one launch.

Each entry reads its logit, applies the repetition, frequency and presence penalties with torch's
roundings (every product, quotient and difference rounded on its own, nothing fused: numerics.py's
EXACT helpers), and writes it back, so the result stays bit-identical to the dense reference. The
entries arrive sorted; a repeat of the entry before it is skipped, so each logit is read and
written by one thread only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.numerics import add_rn, div_rn, exact_rounding, mul_rn

_BLOCK = 1024


@triton.jit
def _sparse_penalties_kernel(
    logits_ptr,  # [B, V] float32, rows row_stride apart, last dim contiguous
    seen_ptr,  # [N] int64 row * V + token, ascending (repeats allowed)
    counts_ptr,  # [N] float32 occurrences of the token in the row's output
    rep_ptr,  # [B] float32 repetition penalties (REP only)
    freq_ptr,  # [B] float32
    pres_ptr,  # [B] float32
    n, vocab_size, row_stride,
    REP: tl.constexpr, EXACT: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    key = tl.load(seen_ptr + i, mask=i < n, other=-1)
    prev = tl.load(seen_ptr + i - 1, mask=(i > 0) & (i < n), other=-1)
    m = (i < n) & (key != prev)  # the first of equal entries does the work
    row = key // vocab_size
    ptr = logits_ptr + row * row_stride + key % vocab_size
    x = tl.load(ptr, mask=m, other=0.0)
    cnt = tl.load(counts_ptr + i, mask=m, other=0.0)
    if REP:
        rep = tl.load(rep_ptr + row, mask=m, other=1.0)
        # Towards "less likely" whatever the sign: divide a positive logit, multiply a negative one.
        x = mul_rn(x, tl.where(x > 0, div_rn(1.0, rep, EXACT), rep), EXACT)
    freq = tl.load(freq_ptr + row, mask=m, other=0.0)
    x = add_rn(x, -mul_rn(freq, cnt, EXACT), EXACT)
    pres = tl.load(pres_ptr + row, mask=m, other=0.0)
    x = add_rn(x, -mul_rn(pres, (cnt > 0).to(tl.float32), EXACT), EXACT)
    tl.store(ptr, x, mask=m)


def sparse_penalties_triton_(
    logits: torch.Tensor,  # [B, V] float32, last dim contiguous (modified)
    seen_index: torch.Tensor,  # [N] int64, ascending
    output_counts: torch.Tensor,  # [N] float32
    repetition: torch.Tensor | None,  # [B] float32, or None: no repetition penalty
    frequency: torch.Tensor,  # [B] float32
    presence: torch.Tensor,  # [B] float32
) -> torch.Tensor:
    n = seen_index.numel()
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1
    if n:
        _sparse_penalties_kernel[(triton.cdiv(n, _BLOCK),)](
            logits, seen_index, output_counts, repetition if repetition is not None else frequency,
            frequency, presence, n, logits.shape[1], logits.stride(0),
            REP=repetition is not None, EXACT=exact_rounding(logits), BLOCK=_BLOCK,
        )
    return logits
