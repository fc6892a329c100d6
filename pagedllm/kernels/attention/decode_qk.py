"""The decode token's q/k transforms inside the attention kernel, in registers: per-head RMSNorm, then neox rotary.

Same arithmetic as ``pagedllm.kernels.rotary`` (and so as ``RotaryEmbedding``): ``freqs =
pos * inv_freq`` in float32, cos/sin times the attention scaling rounded to the activation dtype, and
``x * cos + partner * (+-sin)`` with each product and the sum rounded to that dtype. Channel ``d`` of the
rotated part pairs with ``d + R/2`` (sign -) in the first half and ``d - R/2`` (sign +) in the second;
channels past ``R`` pass through. The per-head RMSNorm (Qwen3, Gemma 3) is ``layers.kernels.qk_norm_rotary``'s:
float32 statistics; Llama style casts the normalized value, then multiplies by the weight in the activation
dtype; Gemma style multiplies by ``1 + w`` in float32 and casts after.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.numerics import exact_rounding, norm_weight, rope_combine


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
def transform_heads(
    x,  # [ROWS, HEAD_SIZE_P2] heads as loaded
    rows_ptr,  # [ROWS, 1] pointers to each row's head (or one pointer for one row)
    mask,  # [ROWS, HEAD_SIZE_P2]
    dims,  # [HEAD_SIZE_P2]
    dim_valid,  # [HEAD_SIZE_P2]
    pos,  # scalar: the token's position
    inv_freq_ptr, rope_scaling, w_ptr, eps,
    HEAD_SIZE: tl.constexpr,
    ROT_HALF: tl.constexpr,
    ROPE: tl.constexpr,
    QK_NORM: tl.constexpr,
    GEMMA_NORM: tl.constexpr,
    EXACT: tl.constexpr,  # kernel_math.exact_rounding
):
    """Heads of q or k after their RMSNorm (QK_NORM, weight ``w_ptr``) and rotary embedding (ROPE), in x's dtype."""
    dt = x.dtype
    if QK_NORM:
        x_f = x.to(tl.float32)
        rstd = (1.0 / tl.sqrt(tl.sum(x_f * x_f, axis=1) / HEAD_SIZE + eps))[:, None]  # [ROWS, 1]
        w = tl.load(w_ptr + dims, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
        normed = norm_weight(x_f * rstd, w, GEMMA_NORM, dt).to(dt)
    if ROPE:
        cos, sin, partner = rope_tables(pos, inv_freq_ptr, rope_scaling, dims, ROT_HALF, dt)
        x_partner = tl.load(rows_ptr + partner[None, :], mask=mask, other=0.0)
        if QK_NORM:
            w_partner = tl.load(w_ptr + partner, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
            x_partner = norm_weight(x_partner.to(tl.float32) * rstd, w_partner, GEMMA_NORM, dt).to(dt)
            x = normed
        x = rope_combine(x.to(tl.float32), x_partner.to(tl.float32), cos[None, :], sin[None, :], dt, EXACT)
    elif QK_NORM:
        x = normed
    return x


@triton.jit
def transform_new_k(
    k_row,  # pointer to the new token's head row
    dims,  # [HEAD_SIZE_P2]
    dim_valid,  # [HEAD_SIZE_P2]
    pos,  # scalar: the token's position
    inv_freq_ptr, rope_scaling, kw_ptr, k_eps,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_P2: tl.constexpr,
    ROT_HALF: tl.constexpr,
    ROPE: tl.constexpr,
    QK_NORM: tl.constexpr,
    GEMMA_NORM: tl.constexpr,
    EXACT: tl.constexpr,
):
    """The new key's head [HEAD_SIZE_P2], loaded and transformed as a one-row ``transform_heads``."""
    mask = dim_valid[None, :]  # [1, HEAD_SIZE_P2]
    k = tl.load(k_row + dims[None, :], mask=mask, other=0.0)
    k = transform_heads(k, k_row, mask, dims, dim_valid, pos, inv_freq_ptr, rope_scaling, kw_ptr, k_eps,
                        HEAD_SIZE, ROT_HALF, ROPE, QK_NORM, GEMMA_NORM, EXACT)
    return tl.reshape(k, [HEAD_SIZE_P2])


@triton.jit
def store_new_token(
    token,  # the decode token's row in new_k / new_v
    slot,  # its cache slot (>= 0)
    kv_head,
    dims,  # [HEAD_SIZE_P2]
    dim_valid,  # [HEAD_SIZE_P2]
    pos,  # its position
    new_k_ptr, new_v_ptr, k_cache_ptr, v_cache_ptr,
    stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_kb, stride_kp, stride_kh,
    inv_freq_ptr, rope_scaling, kw_ptr, k_eps,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROT_HALF: tl.constexpr,
    ROPE: tl.constexpr,
    QK_NORM: tl.constexpr,
    GEMMA_NORM: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Stores the decode token's key (after its norm and rotary embedding, as asked) and value in its cache
    slot, for one KV head; K and V caches share their strides."""
    dst = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kp + kv_head * stride_kh + dims
    k_row = new_k_ptr + token * stride_nkt + kv_head * stride_nkh
    new_k = transform_new_k(k_row, dims, dim_valid, pos, inv_freq_ptr, rope_scaling, kw_ptr, k_eps,
                            HEAD_SIZE, HEAD_SIZE_P2, ROT_HALF, ROPE, QK_NORM, GEMMA_NORM, EXACT)
    new_v = tl.load(new_v_ptr + token * stride_nvt + kv_head * stride_nvh + dims, mask=dim_valid)
    # Through float32: one rounding into any cache type, float8 included (reshape_and_cache.py).
    tl.store(k_cache_ptr + dst, new_k.to(tl.float32).to(k_cache_ptr.dtype.element_ty), mask=dim_valid)
    tl.store(v_cache_ptr + dst, new_v.to(tl.float32).to(v_cache_ptr.dtype.element_ty), mask=dim_valid)


def transform_launch_args(query, placeholder, head_size: int, rope, qk_norm) -> tuple[tuple, dict]:
    """A launch's (inv_freq, scaling, q weight, k weight, q eps, k eps) arguments and its ROPE, ROT_HALF,
    QK_NORM, GEMMA_NORM and EXACT constants, from the host's ``rope`` = (inv_freq [R/2] float32, scaling)
    and ``qk_norm`` = (q weight [D], k weight [D], q eps, k eps, gemma style); ``placeholder`` is any
    tensor, passed where a transform is off."""
    if rope is not None:
        inv_freq, scaling = rope
        assert inv_freq.dtype == torch.float32 and 2 * inv_freq.numel() <= head_size
    else:
        inv_freq, scaling = placeholder, 1.0
    if qk_norm is not None:
        q_w, k_w, q_eps, k_eps, gemma = qk_norm
        assert q_w.numel() == head_size == k_w.numel() and q_w.is_contiguous() and k_w.is_contiguous()
    else:
        q_w, k_w, q_eps, k_eps, gemma = placeholder, placeholder, 0.0, 0.0, False
    args = (inv_freq, scaling, q_w, k_w, float(q_eps), float(k_eps))
    consts = dict(ROPE=rope is not None, ROT_HALF=inv_freq.numel() if rope is not None else 1,
                  QK_NORM=qk_norm is not None, GEMMA_NORM=bool(gemma),
                  EXACT=rope is not None and exact_rounding(query))
    return args, consts
