"""The decode token's q/k rotary embedding inside the attention kernel, in registers (neox style).

Same arithmetic as ``pagedllm.kernels.rotary`` (and so as ``RotaryEmbedding``): ``freqs =
pos * inv_freq`` in float32, cos/sin times the attention scaling rounded to the activation dtype, and
``x * cos + partner * (+-sin)`` with each product and the sum rounded to that dtype. Channel ``d`` of the
rotated part pairs with ``d + R/2`` (sign -) in the first half and ``d - R/2`` (sign +) in the second;
channels past ``R`` pass through. Models with a per-head q/k RMSNorm (Qwen3, Gemma 3) run it with the
rotary embedding in their own launch (``kernels/qk_norm_rotary.py``), which also stores the new K/V.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.attention.fused_inputs import Rope
from pagedllm.kernels.numerics import exact_rounding, rope_combine


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
    inv_freq_ptr, rope_scaling,
    ROT_HALF: tl.constexpr,
    ROPE: tl.constexpr,
    EXACT: tl.constexpr,  # numerics.exact_rounding
):
    """Heads of q or k after their rotary embedding (ROPE; else as loaded), in x's dtype."""
    if ROPE:
        dt = x.dtype
        cos, sin, partner = rope_tables(pos, inv_freq_ptr, rope_scaling, dims, ROT_HALF, dt)
        x_partner = tl.load(rows_ptr + partner[None, :], mask=mask, other=0.0)
        x = rope_combine(x.to(tl.float32), x_partner.to(tl.float32), cos[None, :], sin[None, :], dt, EXACT)
    return x


@triton.jit
def transform_new_k(
    k_row,  # pointer to the new token's head row
    dims,  # [HEAD_SIZE_P2]
    dim_valid,  # [HEAD_SIZE_P2]
    pos,  # scalar: the token's position
    inv_freq_ptr, rope_scaling,
    HEAD_SIZE_P2: tl.constexpr,
    ROT_HALF: tl.constexpr,
    ROPE: tl.constexpr,
    EXACT: tl.constexpr,
):
    """The new key's head [HEAD_SIZE_P2], loaded and transformed as a one-row ``transform_heads``."""
    mask = dim_valid[None, :]  # [1, HEAD_SIZE_P2]
    k = tl.load(k_row + dims[None, :], mask=mask, other=0.0)
    k = transform_heads(k, k_row, mask, dims, dim_valid, pos, inv_freq_ptr, rope_scaling, ROT_HALF, ROPE, EXACT)
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
    inv_freq_ptr, rope_scaling,
    HEAD_SIZE_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROT_HALF: tl.constexpr,
    ROPE: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Stores the decode token's key (after its rotary embedding, as asked) and value in its cache
    slot, for one KV head; K and V caches share their strides."""
    dst = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kp + kv_head * stride_kh + dims
    k_row = new_k_ptr + token * stride_nkt + kv_head * stride_nkh
    new_k = transform_new_k(k_row, dims, dim_valid, pos, inv_freq_ptr, rope_scaling, HEAD_SIZE_P2, ROT_HALF, ROPE,
                            EXACT)
    new_v = tl.load(new_v_ptr + token * stride_nvt + kv_head * stride_nvh + dims, mask=dim_valid)
    # Through float32: one rounding into any cache type, float8 included (reshape_and_cache.py).
    tl.store(k_cache_ptr + dst, new_k.to(tl.float32).to(k_cache_ptr.dtype.element_ty), mask=dim_valid)
    tl.store(v_cache_ptr + dst, new_v.to(tl.float32).to(v_cache_ptr.dtype.element_ty), mask=dim_valid)


def transform_launch_args(
    query: torch.Tensor, placeholder: torch.Tensor, head_size: int, rope: Rope | None
) -> tuple[tuple, dict]:
    """A launch's (inv_freq, scaling) arguments and its ROPE, ROT_HALF and EXACT constants, from the host's
    ``rope``; ``placeholder`` is any tensor, passed where it is off."""
    if rope is not None:
        inv_freq, scaling = rope.inv_freq, rope.scaling
        assert inv_freq.dtype == torch.float32 and 2 * inv_freq.numel() <= head_size
    else:
        inv_freq, scaling = placeholder, 1.0
    consts = dict(ROPE=rope is not None, ROT_HALF=inv_freq.numel() if rope is not None else 1,
                  EXACT=rope is not None and exact_rounding(query))
    return (inv_freq, scaling), consts
