"""Fused Triton kernel for sample/rng.py's add_gumbel_: hashes (row key, token id) to Gumbel noise and adds it to
the logits in one pass. Bit-for-bit the same hash as the eager code in rng.py."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _mix32(x, MUL1: tl.constexpr, MUL2: tl.constexpr):
    # uint32 arithmetic wraps modulo 2**32, which is exactly the masking the eager version does.
    x ^= x >> 16
    x *= MUL1
    x ^= x >> 15
    x *= MUL2
    x ^= x >> 15
    return x


@triton.jit
def _add_gumbel_kernel(
    logits_ptr, key0_ptr, key1_ptr, vocab_size, row_stride,
    MUL1: tl.constexpr, MUL2: tl.constexpr, UNIFORM_BITS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab_size
    key0 = tl.load(key0_ptr + row).to(tl.uint32)
    key1 = tl.load(key1_ptr + row).to(tl.uint32)
    x = cols.to(tl.uint32) + key0
    x = _mix32(x, MUL1, MUL2)
    x ^= key1
    x = _mix32(x, MUL1, MUL2)
    u = ((x >> (32 - UNIFORM_BITS)).to(tl.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))
    noise = -tl.log(-tl.log(u))
    ptrs = logits_ptr + row.to(tl.int64) * row_stride + cols
    vals = tl.load(ptrs, mask=in_vocab)
    tl.store(ptrs, vals + noise, mask=in_vocab)


def add_gumbel_triton_(
    logits: torch.Tensor, key0: torch.Tensor, key1: torch.Tensor, mix_mul: tuple[int, int], uniform_bits: int
) -> torch.Tensor:
    """logits [R, V] float32 CUDA (modified), key0/key1 [R] int64 in [0, 2**32); ``mix_mul`` and ``uniform_bits``:
    the hash's constants, which rng.py defines. Returns logits."""
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return logits
    grid = (num_rows, triton.cdiv(vocab_size, _BLOCK))
    _add_gumbel_kernel[grid](
        logits, key0.contiguous(), key1.contiguous(), vocab_size, logits.stride(0),
        MUL1=mix_mul[0], MUL2=mix_mul[1], UNIFORM_BITS=uniform_bits, BLOCK=_BLOCK,
    )
    return logits
