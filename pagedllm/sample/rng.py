"""Counter-based random numbers for sampling: the noise for one request is a pure function of
(seed, number of tokens it has generated, token id), so draws do not depend on batch composition,
on the order requests arrive in, or on preemption and recomputation."""
from __future__ import annotations

import functools

import torch

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
# 2-round xorshift-multiply mixer constants from Chris Wellons' hash-prospector search; both are
# below 2**31, so a product with a 32-bit value stays below 2**63 and int64 never overflows.
_MIX_MUL_1 = 0x21F0AAAD
_MIX_MUL_2 = 0x735A2D97
# Uniforms keep 23 bits: (2k + 1) / 2**24 with k < 2**23 is exact in float32, so the extremes stay
# strictly inside (0, 1) (with 24 bits the top bucket would round to 1.0 and give infinite noise).
_UNIFORM_BITS = 23


def _splitmix64(x: int) -> int:
    """Well-known 64-bit finaliser; Python ints make the wrap-around explicit with masks."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _fold_seed(seed: int) -> int:
    """Maps any Python int (negative or wider than 64 bits) to 64 bits without dropping limbs."""
    if 0 <= seed <= _M64:
        return seed
    sign = 1 if seed < 0 else 0
    seed = abs(seed)
    acc = sign
    while True:
        acc = _splitmix64(acc ^ (seed & _M64))
        seed >>= 64
        if seed == 0:
            return acc


def row_key(seed: int, step: int) -> tuple[int, int]:
    """Two 32-bit keys for one request at one decoding step (step = output tokens so far)."""
    key = _splitmix64(_splitmix64(_fold_seed(seed)) ^ (step & _M64))
    return key & _M32, key >> 32


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """In-place bijective 32-bit mix of int64 values in [0, 2**32); returns x."""
    x ^= x >> 16
    x *= _MIX_MUL_1
    x &= _M32
    x ^= x >> 15
    x *= _MIX_MUL_2
    x &= _M32
    x ^= x >> 15
    return x


def random_bits(key0: torch.Tensor, key1: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Keyed hash of token ids. key0, key1: [R] int64 in [0, 2**32); token_ids: [V] (the same ids for
    every row) or [R, K] int64 -> [R, V] or [R, K] int64 in [0, 2**32).

    Two keyed rounds (add key0, mix, xor key1, mix) so that rows whose keys differ by a constant are
    not merely shifted copies of each other.
    """
    x = token_ids + key0.unsqueeze(1)
    x &= _M32
    _mix32_(x)
    x ^= key1.unsqueeze(1)
    return _mix32_(x)


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """[...] int64 in [0, 2**32) -> [...] float32 strictly inside (0, 1), from the top bits."""
    u = (bits >> (32 - _UNIFORM_BITS)).to(torch.float32)
    u += 0.5  # centre of each bucket, so 0 and 1 are never produced
    u *= 2.0**-_UNIFORM_BITS
    return u


def gumbel(key0: torch.Tensor, key1: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise for the given token ids (shapes as in random_bits), float32.
    argmax(logits + noise) is a draw from softmax(logits)."""
    u = bits_to_uniform(random_bits(key0, key1, token_ids))
    u.log_().neg_().log_().neg_()
    return u


def vocab_ids(vocab_size: int, device: torch.device) -> torch.Tensor:
    """[V] int64 token ids 0..V-1, the token_ids argument for noise over the whole vocabulary."""
    return torch.arange(vocab_size, dtype=torch.int64, device=device)


@functools.cache
def _max_noise() -> float:
    """The largest value ``gumbel`` can return (from the largest uniform), computed with its own ops."""
    top = torch.tensor([[_M32]], dtype=torch.int64)
    u = bits_to_uniform(top)
    return float(u.log_().neg_().log_().neg_())


# Margin for float32 rounding in the pruning bound of gumbel_argmax (relative to the values' size).
_PRUNE_SLACK = 1e-4


def gumbel_argmax(logits: torch.Tensor, key0: torch.Tensor, key1: torch.Tensor) -> torch.Tensor:
    """argmax over each row of logits + the Gumbel noise of every token id: [R, V] float32 (may be
    modified) -> [R] int64, the token ``add_gumbel_(logits, key0, key1).argmax(-1)`` picks (the first
    index among equal maxima).

    Off CUDA most of the vocabulary usually needs no noise at all: the row's largest logit plus its own
    noise is a value the winner reaches, and no noise exceeds the largest possible one, so a token whose
    logit is below that value minus the largest noise cannot win. When a row is flat enough that most
    tokens (over 1 in 16) could still win, noise for all of them is cheaper than selecting them.
    """
    if logits.is_cuda:
        return add_gumbel_(logits, key0, key1).argmax(dim=-1)
    num_rows, vocab_size = logits.shape
    top_vals, top_ids = logits.max(dim=-1)  # [R]
    reached = top_vals + gumbel(key0, key1, top_ids.unsqueeze(1)).squeeze(1)  # [R] float32
    cutoff = reached - _max_noise() - _PRUNE_SLACK * (reached.abs() + 1.0)
    # Every 8th column estimates how many tokens could still win (a full count costs as much as a pass).
    sample = logits[:, ::8] >= cutoff.unsqueeze(1)
    if 16 * int(sample.count_nonzero()) > sample.numel():
        return add_gumbel_(logits, key0, key1).argmax(dim=-1)
    rows, ids = (logits >= cutoff.unsqueeze(1)).nonzero(as_tuple=True)  # [N], [N]; row-major order
    vals = logits[rows, ids] + gumbel(key0[rows], key1[rows], ids.unsqueeze(1)).squeeze(1)  # [N]
    best = torch.full((num_rows,), float("-inf"), dtype=vals.dtype).scatter_reduce_(0, rows, vals, "amax")
    first = torch.where(vals == best[rows], ids, vocab_size)
    return torch.full((num_rows,), vocab_size, dtype=torch.int64).scatter_reduce_(0, rows, first, "amin")


# Off CUDA, noise is computed for about this many (row, token id) pairs at a time: its ~20 int64 passes
# then run in cache (about 5x faster than 16 rows of a 262k-token vocabulary at once), while a few
# rows still take few, large blocks (each block costs ~20 op dispatches).
_NOISE_BLOCK_ELEMENTS = 262144


def add_gumbel_(logits: torch.Tensor, key0: torch.Tensor, key1: torch.Tensor) -> torch.Tensor:
    """logits [R, V] float32 += Gumbel noise of every token id; returns logits.

    On CUDA a fused Triton kernel computes the same bits without materialising the int64
    intermediates (about 20 passes over [R, V] in eager mode); elsewhere the eager version runs, on a
    block of token ids at a time.
    """
    if logits.is_cuda and logits.is_contiguous():
        try:
            from pagedllm.kernels.sampling.gumbel import add_gumbel_triton_
        except ImportError:  # no Triton on this machine
            pass
        else:
            return add_gumbel_triton_(logits, key0, key1, (_MIX_MUL_1, _MIX_MUL_2), _UNIFORM_BITS)
    vocab_size = logits.shape[-1]
    block = vocab_size if logits.is_cuda else max(4096, _NOISE_BLOCK_ELEMENTS // max(1, logits.shape[0]))
    for start in range(0, vocab_size, block):
        ids = torch.arange(start, min(start + block, vocab_size), dtype=torch.int64, device=logits.device)
        logits[:, start : start + block].add_(gumbel(key0, key1, ids))
    return logits
