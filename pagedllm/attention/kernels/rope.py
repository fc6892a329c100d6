"""Neox rotary embedding inside the decode attention kernel: the new token's q and k rotate in registers.

Same arithmetic as ``pagedllm.layers.kernels.rotary`` (and so as ``RotaryEmbedding``): ``freqs =
pos * inv_freq`` in float32, cos/sin times the attention scaling rounded to the activation dtype, and
``x * cos + partner * (+-sin)`` with each product and the sum rounded to that dtype. Channel ``d`` of the
rotated part pairs with ``d + R/2`` (sign -) in the first half and ``d - R/2`` (sign +) in the second;
channels past ``R`` pass through.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_tables(
    pos,  # scalar int: the token's position
    inv_freq_ptr,  # [R/2] float32
    scaling,
    dims,  # [HEAD_SIZE_P2] channel indices
    ROT_HALF: tl.constexpr,  # R/2
    DT: tl.constexpr,  # activation dtype the products round to
):
    """(cos [D], signed sin [D], partner channel [D]) of one position; identity on channels >= R."""
    is_rot = dims < 2 * ROT_HALF
    inv = tl.load(inv_freq_ptr + dims % ROT_HALF, mask=is_rot, other=0.0)
    freqs = pos.to(tl.float32) * inv
    cos = (tl.cos(freqs) * scaling).to(DT).to(tl.float32)
    sin = (tl.sin(freqs) * scaling).to(DT).to(tl.float32)
    cos = tl.where(is_rot, cos, 1.0)
    sin = tl.where(is_rot, tl.where(dims < ROT_HALF, -sin, sin), 0.0)
    partner = tl.where(is_rot, (dims + ROT_HALF) % (2 * ROT_HALF), dims)
    return cos, sin, partner


@triton.jit
def rope_rotate(x, x_partner, cos, sin):
    """x * cos + partner * sin in x's dtype, rounding each product and the sum like torch's half ops."""
    dt = x.dtype
    a = (x.to(tl.float32) * cos).to(dt).to(tl.float32)
    b = (x_partner.to(tl.float32) * sin).to(dt).to(tl.float32)
    return (a + b).to(dt)
