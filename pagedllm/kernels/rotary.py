"""Triton neox-style rotary embedding applied to q and k in place, cos/sin computed in the kernel (one launch per step).

Same math as ``pagedllm.layers.rotary.RotaryEmbedding``: ``freqs = pos * inv_freq`` in float32,
``cos/sin * attention_scaling`` rounded to the activations' dtype, then ``x*cos + rotate_half(x)*sin``
with each product and the sum rounded to that dtype as torch's half arithmetic does. Channels past
``rotary_dim`` (partial rotary) are left untouched.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.launch import pdl_launch_args, wait_for_previous_kernel
from pagedllm.kernels.numerics import exact_rounding, rope_combine

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotate_heads(
    base_ptr,  # this token's row of q or k: [num_heads, head_stride], rotary channels first
    num_heads,
    stride_h,
    cos, sin,  # [1, HALF_P2] float32, already rounded to the activation dtype
    half,
    HALF_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EXACT: tl.constexpr,  # kernel_math.exact_rounding
):
    dims = tl.arange(0, HALF_P2)[None, :]  # [1, HALF_P2]
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        mask = (heads < num_heads) & (dims < half)  # [BLOCK_H, HALF_P2]
        p1 = base_ptr + heads * stride_h + dims  # [BLOCK_H, HALF_P2] first half
        x1_raw = tl.load(p1, mask=mask, other=0.0)
        x2_raw = tl.load(p1 + half, mask=mask, other=0.0)
        dt = x1_raw.dtype
        x1 = x1_raw.to(tl.float32)
        x2 = x2_raw.to(tl.float32)
        # rot*cos + cat(-x2, x1)*sin, each product and the sum rounded like torch's half ops.
        tl.store(p1, rope_combine(x1, -x2, cos, sin, dt, EXACT), mask=mask)
        tl.store(p1 + half, rope_combine(x2, x1, cos, sin, dt, EXACT), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,  # [T] int
    inv_freq_ptr,  # [R/2] float32
    q_ptr,  # [T, Hq, D] addressed by strides, last dim contiguous
    k_ptr,  # [T, Hkv, D] addressed by strides, last dim contiguous
    num_q_heads, num_k_heads,
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    half,  # R/2
    scaling,
    HALF_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EXACT: tl.constexpr,  # kernel_math.exact_rounding
    USE_GDC: tl.constexpr,  # launched with PDL: wait for the previous kernel first (kernels/launch.py)
):
    wait_for_previous_kernel(USE_GDC, True)
    tok = tl.program_id(0)
    dims = tl.arange(0, HALF_P2)  # [HALF_P2]
    pos = tl.load(pos_ptr + tok).to(tl.float32)
    inv = tl.load(inv_freq_ptr + dims, mask=dims < half, other=0.0)
    freqs = pos * inv  # [HALF_P2] float32
    dt = q_ptr.dtype.element_ty
    cos = (tl.cos(freqs) * scaling).to(dt).to(tl.float32)[None, :]  # [1, HALF_P2]
    sin = (tl.sin(freqs) * scaling).to(dt).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + tok * stride_qt, num_q_heads, stride_qh, cos, sin, half, HALF_P2, BLOCK_H, EXACT)
    _rotate_heads(k_ptr + tok * stride_kt, num_k_heads, stride_kh, cos, sin, half, HALF_P2, BLOCK_H, EXACT)


def _heads_view(t: torch.Tensor, head_size: int) -> tuple[int, int, int] | None:
    """(token stride, head stride, heads) of a [T, H*D] or [T, H, D] tensor, or None if unaddressable."""
    if t.stride(-1) != 1:
        return None
    if t.dim() == 2 and t.shape[1] % head_size == 0:
        return t.stride(0), head_size, t.shape[1] // head_size
    if t.dim() == 3 and t.shape[2] == head_size:
        return t.stride(0), t.stride(1), t.shape[1]
    return None


def usable(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, head_size: int, is_neox_style: bool) -> bool:
    return (
        is_neox_style
        and query.dtype in SUPPORTED_DTYPES
        and key.dtype == query.dtype
        and positions.dim() == 1
        and query.shape[0] == key.shape[0] == positions.shape[0]
        and query.shape[0] > 0
        and _heads_view(query, head_size) is not None
        and _heads_view(key, head_size) is not None
    )


def rotary_neox_(
    positions: torch.Tensor,  # [T] int
    query: torch.Tensor,  # [T, Hq*D] or [T, Hq, D], rotated in place
    key: torch.Tensor,  # [T, Hkv*D] or [T, Hkv, D], rotated in place
    inv_freq: torch.Tensor,  # [R/2] float32, contiguous
    head_size: int,
    attention_scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    sqt, sqh, hq = _heads_view(query, head_size)
    skt, skh, hk = _heads_view(key, head_size)
    half = inv_freq.numel()
    half_p2 = triton.next_power_of_2(half)
    # Bound a tile at ~4K elements per half so registers stay small whatever the head count.
    block_h = max(1, min(triton.next_power_of_2(max(hq, hk)), 4096 // half_p2))
    _rotary_kernel[(query.shape[0],)](
        positions, inv_freq, query, key,
        hq, hk, sqt, sqh, skt, skh,
        half, attention_scaling,
        HALF_P2=half_p2, BLOCK_H=block_h, EXACT=exact_rounding(query), num_warps=4, **pdl_launch_args(query),
    )
    return query, key
