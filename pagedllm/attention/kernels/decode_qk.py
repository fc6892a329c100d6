"""The decode token's q/k transforms inside the attention kernel, in registers: per-head RMSNorm, then neox rotary.

Same arithmetic as ``pagedllm.layers.kernels.rotary`` (and so as ``RotaryEmbedding``): ``freqs =
pos * inv_freq`` in float32, cos/sin times the attention scaling rounded to the activation dtype, and
``x * cos + partner * (+-sin)`` with each product and the sum rounded to that dtype. Channel ``d`` of the
rotated part pairs with ``d + R/2`` (sign -) in the first half and ``d - R/2`` (sign +) in the second;
channels past ``R`` pass through. The per-head RMSNorm (Qwen3, Gemma 3) is ``layers.kernels.qk_norm_rotary``'s:
float32 statistics; Llama style casts the normalized value, then multiplies by the weight in the activation
dtype; Gemma style multiplies by ``1 + w`` in float32 and casts after.
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
def rms_weighted(x, rstd, w, GEMMA: tl.constexpr, DT: tl.constexpr):
    """RMSNorm output of float32 ``x`` given its ``rstd`` and float32 weight ``w``, as float32 holding a DT value."""
    normed = x * rstd
    if GEMMA:
        out = normed * (1.0 + w)
    else:
        out = w * normed.to(DT).to(tl.float32)
    return out.to(DT).to(tl.float32)


@triton.jit
def rope_rotate(x, x_partner, cos, sin):
    """x * cos + partner * sin in x's dtype, rounding each product and the sum like torch's half ops."""
    dt = x.dtype
    a = (x.to(tl.float32) * cos).to(dt).to(tl.float32)
    b = (x_partner.to(tl.float32) * sin).to(dt).to(tl.float32)
    return (a + b).to(dt)


@triton.jit
def transform_q(
    q,  # [BLOCK_M, HEAD_SIZE_P2] as loaded
    q_rows,  # [BLOCK_M, 1] pointers to each row's head
    q_mask,  # [BLOCK_M, HEAD_SIZE_P2]
    dims,  # [HEAD_SIZE_P2]
    dim_valid,  # [HEAD_SIZE_P2]
    pos,  # scalar: the token's position
    inv_freq_ptr, rope_scaling, qw_ptr, q_eps,
    HEAD_SIZE: tl.constexpr,
    ROT_HALF: tl.constexpr,
    ROPE: tl.constexpr,
    QK_NORM: tl.constexpr,
    GEMMA_NORM: tl.constexpr,
):
    """q after its RMSNorm (QK_NORM) and rotary embedding (ROPE), in q's dtype."""
    dt = q.dtype
    if QK_NORM:
        q_f = q.to(tl.float32)
        rstd = (1.0 / tl.sqrt(tl.sum(q_f * q_f, axis=1) / HEAD_SIZE + q_eps))[:, None]  # [BLOCK_M, 1]
        w = tl.load(qw_ptr + dims, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
        normed = rms_weighted(q_f, rstd, w, GEMMA_NORM, dt).to(dt)
    if ROPE:
        cos, sin, partner = rope_tables(pos, inv_freq_ptr, rope_scaling, dims, ROT_HALF, dt)
        q_partner = tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0)
        if QK_NORM:
            w_partner = tl.load(qw_ptr + partner, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
            q_partner = rms_weighted(q_partner.to(tl.float32), rstd, w_partner, GEMMA_NORM, dt).to(dt)
            q = normed
        q = rope_rotate(q, q_partner, cos[None, :], sin[None, :])
    elif QK_NORM:
        q = normed
    return q


@triton.jit
def transform_new_k(
    k_row,  # pointer to the new token's head row
    dims,  # [HEAD_SIZE_P2]
    dim_valid,  # [HEAD_SIZE_P2]
    pos,  # scalar: the token's position
    inv_freq_ptr, rope_scaling, kw_ptr, k_eps,
    HEAD_SIZE: tl.constexpr,
    ROT_HALF: tl.constexpr,
    ROPE: tl.constexpr,
    QK_NORM: tl.constexpr,
    GEMMA_NORM: tl.constexpr,
):
    """The new key's head [HEAD_SIZE_P2] after its RMSNorm (QK_NORM) and rotary embedding (ROPE)."""
    k = tl.load(k_row + dims, mask=dim_valid, other=0.0)
    dt = k.dtype
    if QK_NORM:
        k_f = k.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(k_f * k_f, axis=0) / HEAD_SIZE + k_eps)
        w = tl.load(kw_ptr + dims, mask=dim_valid, other=0.0).to(tl.float32)
        normed = rms_weighted(k_f, rstd, w, GEMMA_NORM, dt).to(dt)
    if ROPE:
        cos, sin, partner = rope_tables(pos, inv_freq_ptr, rope_scaling, dims, ROT_HALF, dt)
        k_partner = tl.load(k_row + partner, mask=dim_valid, other=0.0)
        if QK_NORM:
            w_partner = tl.load(kw_ptr + partner, mask=dim_valid, other=0.0).to(tl.float32)
            k_partner = rms_weighted(k_partner.to(tl.float32), rstd, w_partner, GEMMA_NORM, dt).to(dt)
            k = normed
        k = rope_rotate(k, k_partner, cos, sin)
    elif QK_NORM:
        k = normed
    return k
