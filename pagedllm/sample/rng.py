"""Counter-based random numbers for sampling: the noise for one request is a pure function of
(seed, number of tokens it has generated, token id), so draws do not depend on batch composition,
on the order requests arrive in, or on preemption and recomputation."""
from __future__ import annotations

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


def random_bits(key0: torch.Tensor, key1: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Keyed hash of every token id. key0, key1: [R] int64 in [0, 2**32) -> [R, V] int64 in [0, 2**32).

    Two keyed rounds (add key0, mix, xor key1, mix) so that rows whose keys differ by a constant are
    not merely shifted copies of each other.
    """
    cols = torch.arange(vocab_size, dtype=torch.int64, device=key0.device)
    x = cols.unsqueeze(0) + key0.unsqueeze(1)
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


def uniform(key0: torch.Tensor, key1: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform numbers strictly inside (0, 1): [R] keys -> [R, V] float32."""
    return bits_to_uniform(random_bits(key0, key1, vocab_size))


def gumbel(key0: torch.Tensor, key1: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [R, V] float32: argmax(logits + noise) samples softmax(logits)."""
    u = uniform(key0, key1, vocab_size)
    u.log_().neg_().log_().neg_()
    return u
