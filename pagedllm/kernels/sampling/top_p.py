"""Triton top-k/top-p truncation without a sort: each row's threshold found by a 16-way search over float keys.

The rule is truncation.apply_top_k_top_p's: top-k keeps values at or above the k-th largest; top-p
then keeps each value whose strictly better tokens hold less than p of the probability left after
top-k, ties with the last kept value included. Both are "keep values >= threshold" for one threshold
per row. A float's key is its bit pattern mapped to an order-preserving integer; the threshold is the
smallest key kappa with F(kappa) < target, F(kappa) = the summed weight of the keys above kappa (1 per
token for top-k, target k; exp(x - max) for top-p, target p * sum). F drops only at the tokens' own
keys, so that smallest kappa is a token's key. Each pass is one launch over (row, chunk of the
vocabulary): it first finishes the previous pass (sums that row's chunk partials and narrows the row's
key interval 16-fold), then weighs its chunk against the 16 new pivots. 8 passes cover the 2**32 keys.
Masses are summed in another order than a sort's cumulative sum, so a token whose mass-before lies
within float32 rounding of p may land on the other side than in the sorted reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens per program (loaded at once) and warps: the best of an H200 sweep (benchmarks/top_p_kernel.py).
_CHUNK = 4096
_WARPS = 4
_WAYS = 16
_PASSES = 8  # 16 ** 8 == 2 ** 32 keys
_TOP = 0xFFFFFFFF


@triton.jit
def _narrow(lo, hi, above, WAYS: tl.constexpr):
    """The sub-interval of (lo, hi] holding the answer, from F at its WAYS pivots (non-increasing)."""
    ways = (tl.arange(0, WAYS) + 1).to(tl.int64)
    first = tl.min(tl.where(above < 0.0, ways, WAYS), axis=0)  # above holds F - target
    width = hi - lo
    return lo + (width * (first - 1)) // WAYS, lo + (width * first) // WAYS


@triton.jit
def _search_pass_kernel(
    logits_ptr,  # [R, V] float32, last dim contiguous
    target_ptr,  # [R] float32
    row_max_ptr,  # [R] float32 (MASS only)
    state_in_ptr,  # [R, 2] int64: (lo, hi) after the previous pass (not FIRST)
    state_out_ptr,  # [R, 2] int64: (lo, hi) after the previous pass, written by chunk 0
    part_in_ptr,  # [R, C, WAYS] float32: the previous pass's chunk sums at its pivots (not FIRST)
    part_out_ptr,  # [R, C, WAYS] float32: this pass's chunk sums (not FINISH)
    vocab_size, stride_row, num_chunks,
    MASS: tl.constexpr, FIRST: tl.constexpr, FINISH: tl.constexpr,
    CHUNK: tl.constexpr, WAYS: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    target = tl.load(target_ptr + row)
    ways = (tl.arange(0, WAYS) + 1).to(tl.int64)
    if FIRST:
        lo = tl.zeros([], dtype=tl.int64)
        hi = tl.full([], 0xFFFFFFFF, dtype=tl.int64)
    else:
        lo = tl.load(state_in_ptr + row * 2)
        hi = tl.load(state_in_ptr + row * 2 + 1)
        cs = tl.arange(0, 64)
        above = tl.zeros([WAYS], dtype=tl.float32)
        for c0 in range(0, num_chunks, 64):
            rows_c = c0 + cs
            part = tl.load(part_in_ptr + (row * num_chunks + rows_c)[:, None] * WAYS + tl.arange(0, WAYS)[None, :],
                           mask=(rows_c < num_chunks)[:, None], other=0.0)  # [64, WAYS]
            above += tl.sum(part, axis=0)
        lo, hi = _narrow(lo, hi, above - target, WAYS)
    if chunk == 0:
        tl.store(state_out_ptr + row * 2, lo)
        tl.store(state_out_ptr + row * 2 + 1, hi)
    if not FINISH:
        row_max = 0.0
        if MASS:
            row_max = tl.load(row_max_ptr + row)
        # The whole chunk in one load: each pivot's sum is then one reduction over it, and the keys stay
        # in the layout they were loaded in (a [CHUNK, WAYS] compare would move them between threads).
        idx = chunk * CHUNK + tl.arange(0, CHUNK)
        valid = idx < vocab_size
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + idx, mask=valid, other=float("-inf"))
        bits = (x + 0.0).to(tl.int32, bitcast=True)  # + 0.0 turns -0.0 into +0.0
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        if MASS:
            w = tl.where(valid, tl.exp(x - row_max), 0.0)
        else:
            w = tl.where(valid, 1.0, 0.0)
        sums = tl.zeros([WAYS], dtype=tl.float32)
        for j in tl.static_range(WAYS):
            # Pivot j + 1 of WAYS as a signed key: a signed key compares like its float.
            pivot = (lo + (hi - lo) * (j + 1) // WAYS - 0x80000000).to(tl.int32)
            sums = tl.where(ways == j + 1, tl.sum(tl.where(key > pivot, w, 0.0), axis=0), sums)
        tl.store(part_out_ptr + (row * num_chunks + chunk) * WAYS + tl.arange(0, WAYS), sums)


def _threshold(logits: torch.Tensor, target: torch.Tensor, row_max: torch.Tensor | None) -> torch.Tensor:
    """[R] float32: per row the smallest value whose strictly larger tokens weigh less than target."""
    num_rows, vocab_size = logits.shape
    num_chunks = triton.cdiv(vocab_size, _CHUNK)
    parts = torch.empty(2, num_rows, num_chunks, _WAYS, dtype=torch.float32, device=logits.device)
    states = torch.empty(2, num_rows, 2, dtype=torch.int64, device=logits.device)
    for t in range(_PASSES + 1):
        finish = t == _PASSES
        _search_pass_kernel[(num_rows, 1 if finish else num_chunks)](
            logits, target, row_max if row_max is not None else target,
            states[(t + 1) % 2], states[t % 2], parts[(t + 1) % 2], parts[t % 2],
            vocab_size, logits.stride(0), num_chunks,
            MASS=row_max is not None, FIRST=t == 0, FINISH=finish,
            CHUNK=_CHUNK, WAYS=_WAYS, num_warps=_WARPS,
        )
    # The answer (hi) back to a float: unsigned key -> signed key -> float bits.
    s = (states[_PASSES % 2, :, 1] - 0x80000000).to(torch.int32)
    return (s ^ ((s >> 31) & 0x7FFFFFFF)).view(torch.float32)


def top_k_top_p_triton_(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """logits [R, V] float32, last dim contiguous (modified); top_k [R] int64 (V = disabled) or None;
    top_p [R] float32 (1.0 = disabled). Returns logits with every truncated token at -inf."""
    num_rows, vocab_size = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1
    if num_rows == 0:
        return logits
    if top_k is not None:
        kth = _threshold(logits, top_k.to(torch.float32), None)
        logits.masked_fill_((logits < kth.unsqueeze(1)) & (top_k < vocab_size).unsqueeze(1), float("-inf"))
    row_max = logits.amax(dim=-1)  # [R]
    total = (logits - row_max.unsqueeze(1)).exp_().sum(dim=-1)  # [R]
    threshold = _threshold(logits, top_p * total, row_max)
    return logits.masked_fill_((logits < threshold.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1), float("-inf"))
