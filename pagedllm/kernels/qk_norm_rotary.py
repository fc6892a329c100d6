"""One Triton launch for Qwen3/Gemma 3 per-head q/k RMSNorm then neox rotary, in place on the q and k slices of the qkv output.

It replaces what the decoder otherwise runs per layer on CUDA: two RMSNorm launches (each writing a
fresh ``[T, H, D]`` copy of q or k) and one rotary launch over those copies. Here every head is read
once from the fused qkv projection output, normalized and rotated in registers, and written back
over itself, so q and k stay strided views of that output and no copy is made.

The op order is the torch path's (``pagedllm.layers.norm`` then ``pagedllm.layers.rotary``):
float32 statistics; Llama casts the normalized head to the activation dtype and multiplies by the
weight in that dtype, Gemma multiplies by ``1 + w`` in float32 and casts after; then
``freqs = pos * inv_freq`` in float32, ``cos/sin * attention_scaling`` rounded to the activation
dtype, and ``x*cos + rotate_half(x)*sin`` with each product and the sum rounded to that dtype.
Channels past ``rotary_dim`` (partial rotary) are normalized but not rotated.

With ``cache`` the same launch also stores each token's finished key and its value into the paged KV
cache at its slot (what ``reshape_and_cache`` would do next, with the same bits), so the attention
launch neither writes the cache nor waits on a write: one launch and one barrier less a layer.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.kernels.launch import pdl_launch_args, wait_for_previous_kernel
from pagedllm.kernels.numerics import exact_rounding, norm_weight, rope_combine
from pagedllm.kernels.rotary import _heads_view

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _norm_rotate_heads(
    base_ptr,  # this token's row of q or k: [num_heads, stride_h], head channels contiguous
    w_ptr,  # [D] norm weight, contiguous (its pass-through channels are read here)
    w1, w2,  # [1, HALF_P2] float32: the weight's two rotary halves, loaded by the caller
    h0,  # first head of this program's tile
    num_heads,
    stride_h,
    eps,
    head_size,  # D
    half,  # rotary_dim / 2
    cos, sin,  # [1, HALF_P2] float32, already rounded to the activation dtype
    GEMMA: tl.constexpr,
    HAS_REST: tl.constexpr,  # partial rotary: channels [2*half, D) pass through unrotated
    HALF_P2: tl.constexpr,
    REST_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EXACT: tl.constexpr,  # kernel_math.exact_rounding
    cache_ptr,  # this token's cache row [num_heads, stride_ch] (used only when WRITE_CACHE)
    stride_ch,
    has_slot,  # whether the token owns a cache slot (padding does not)
    WRITE_CACHE: tl.constexpr,  # also store the result there, cast to the cache's dtype
):
    dims = tl.arange(0, HALF_P2)[None, :]  # [1, HALF_P2]
    heads = h0 + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    hmask = heads < num_heads
    dmask = dims < half
    mask = hmask & dmask  # [BLOCK_H, HALF_P2]
    # The head is read as its two rotary halves (and the pass-through rest), so rotate_half needs
    # no register shuffle and every element is loaded exactly once.
    p1 = base_ptr + heads * stride_h + dims  # [BLOCK_H, HALF_P2]
    x1_raw = tl.load(p1, mask=mask, other=0.0)
    dt = x1_raw.dtype
    x1 = x1_raw.to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
    sumsq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [BLOCK_H]
    if HAS_REST:
        rdims = tl.arange(0, REST_P2)[None, :]  # [1, REST_P2]
        rmask = hmask & (rdims < head_size - 2 * half)
        pr = base_ptr + heads * stride_h + 2 * half + rdims  # [BLOCK_H, REST_P2]
        xr = tl.load(pr, mask=rmask, other=0.0).to(tl.float32)
        sumsq += tl.sum(xr * xr, axis=1)
    # Same expression as the rmsnorm kernel: mean of squares over the whole head, then 1/sqrt.
    rstd = (1.0 / tl.sqrt(sumsq / head_size + eps))[:, None]  # [BLOCK_H, 1] float32

    n1 = norm_weight(x1 * rstd, w1, GEMMA, dt)  # [BLOCK_H, HALF_P2], dt-rounded values in float32
    n2 = norm_weight(x2 * rstd, w2, GEMMA, dt)
    # rot*cos + cat(-x2, x1)*sin, each product and the sum rounded like torch's half ops (kernels/rotary.py).
    r1 = rope_combine(n1, -n2, cos, sin, dt, EXACT)  # [BLOCK_H, HALF_P2] dt
    r2 = rope_combine(n2, n1, cos, sin, dt, EXACT)
    tl.store(p1, r1, mask=mask)
    tl.store(p1 + half, r2, mask=mask)
    if WRITE_CACHE:
        # Through float32, one rounding from dt, as reshape_and_cache stores the value just written.
        ct = cache_ptr.dtype.element_ty
        c1 = cache_ptr + heads * stride_ch + dims
        tl.store(c1, r1.to(tl.float32).to(ct), mask=mask & has_slot)
        tl.store(c1 + half, r2.to(tl.float32).to(ct), mask=mask & has_slot)
    if HAS_REST:
        wr = tl.load(w_ptr + 2 * half + rdims, mask=rdims < head_size - 2 * half, other=0.0).to(tl.float32)
        rest = norm_weight(xr * rstd, wr, GEMMA, dt).to(dt)
        tl.store(pr, rest, mask=rmask)
        if WRITE_CACHE:
            tl.store(cache_ptr + heads * stride_ch + 2 * half + rdims, rest.to(tl.float32).to(cache_ptr.dtype.element_ty),
                     mask=rmask & has_slot)


@triton.jit
def _qk_norm_rotary_kernel(
    pos_ptr,  # [T] int
    inv_freq_ptr,  # [R/2] float32
    q_ptr,  # [T, Hq, D] addressed by strides, head channels contiguous; rewritten in place
    k_ptr,  # [T, Hkv, D] likewise
    qw_ptr,  # [D] q_norm weight
    kw_ptr,  # [D] k_norm weight
    num_q_heads, num_k_heads,
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    q_eps, k_eps,
    head_size,
    half,  # R/2
    scaling,
    num_q_blocks,  # cdiv(Hq, BLOCK_H): tiles 0..num_q_blocks-1 of axis 1 are q, the rest k
    v_ptr,  # [T, Hkv, D] addressed by strides (read only when WRITE_CACHE)
    stride_vt, stride_vh,
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D], last dim contiguous (only when WRITE_CACHE)
    v_cache_ptr,  # likewise
    slot_ptr,  # [T] int64: block * BLOCK_SIZE + offset; < 0 (padding) owns no slot
    stride_cb, stride_cp, stride_ch,  # the caches' block, page and head strides (k and v alike)
    GEMMA: tl.constexpr,
    HAS_REST: tl.constexpr,
    HALF_P2: tl.constexpr,
    REST_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EXACT: tl.constexpr,  # kernel_math.exact_rounding
    WRITE_CACHE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # the cache's tokens per block
    D_P2: tl.constexpr,  # next power of two of D, for the value copy
    USE_GDC: tl.constexpr,  # launched with PDL: wait for the previous kernel first (kernels/launch.py)
):
    # int64: tok * stride_qt passes 2**31 for long prefills of wide models.
    tok = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    is_q = blk < num_q_blocks
    # Positions, slots and weights were written before this step's first launch, never by the previous
    # kernel: under PDL they load (and cos/sin are computed) while that kernel finishes.
    dims = tl.arange(0, HALF_P2)  # [HALF_P2]
    dmask = dims[None, :] < half
    pos = tl.load(pos_ptr + tok).to(tl.float32)
    inv = tl.load(inv_freq_ptr + dims, mask=dims < half, other=0.0)
    freqs = pos * inv  # [HALF_P2] float32
    dt = q_ptr.dtype.element_ty
    cos = (tl.cos(freqs) * scaling).to(dt).to(tl.float32)[None, :]  # [1, HALF_P2]
    sin = (tl.sin(freqs) * scaling).to(dt).to(tl.float32)[None, :]
    w_ptr = tl.where(is_q, qw_ptr, kw_ptr)
    w1 = tl.load(w_ptr + dims[None, :], mask=dmask, other=0.0).to(tl.float32)  # [1, HALF_P2]
    w2 = tl.load(w_ptr + half + dims[None, :], mask=dmask, other=0.0).to(tl.float32)
    row_off = 0
    has_slot = False
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + tok)
        has_slot = slot >= 0  # (k programs only use it)
        row_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cp
    wait_for_previous_kernel(USE_GDC, True)
    # A tile of heads, not a whole token, per program: small decode batches get several programs a token.
    if is_q:
        _norm_rotate_heads(
            q_ptr + tok * stride_qt, w_ptr, w1, w2, blk * BLOCK_H, num_q_heads, stride_qh, q_eps, head_size, half,
            cos, sin, GEMMA, HAS_REST, HALF_P2, REST_P2, BLOCK_H, EXACT, q_ptr, 0, False, False,
        )
    else:
        h0 = (blk - num_q_blocks) * BLOCK_H
        _norm_rotate_heads(
            k_ptr + tok * stride_kt, w_ptr, w1, w2, h0, num_k_heads, stride_kh, k_eps, head_size, half, cos, sin,
            GEMMA, HAS_REST, HALF_P2, REST_P2, BLOCK_H, EXACT, k_cache_ptr + row_off, stride_ch, has_slot,
            WRITE_CACHE,
        )
        if WRITE_CACHE:
            heads = h0 + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
            ch = tl.arange(0, D_P2)[None, :]  # [1, D_P2]
            vmask = (heads < num_k_heads) & (ch < head_size) & has_slot
            v = tl.load(v_ptr + tok * stride_vt + heads * stride_vh + ch, mask=vmask)
            tl.store(v_cache_ptr + row_off + heads * stride_ch + ch, v.to(tl.float32).to(v_cache_ptr.dtype.element_ty),
                     mask=vmask)


def _weight_ok(weight: torch.Tensor, x: torch.Tensor, head_size: int, gemma: bool) -> bool:
    return (
        weight.dim() == 1
        and weight.numel() == head_size
        and weight.is_contiguous()
        and weight.device == x.device
        # Llama multiplies in the weight's dtype, so another dtype would make torch type-promote;
        # Gemma casts the weight to float32 anyway.
        and (weight.dtype in SUPPORTED_DTYPES if gemma else weight.dtype == x.dtype)
    )


def usable(
    positions: torch.Tensor,  # [T] int
    query: torch.Tensor,  # [T, Hq*D] or [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv*D] or [T, Hkv, D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    inv_freq: torch.Tensor,  # [R/2] float32
    head_size: int,
    is_neox_style: bool,
    gemma: bool,
) -> bool:
    """Whether the kernel computes the torch path's result for these tensors (else use the torch path)."""
    return (
        is_neox_style
        and query.dtype in SUPPORTED_DTYPES
        and key.dtype == query.dtype
        and positions.dim() == 1
        and not positions.is_floating_point()
        and query.shape[0] == key.shape[0] == positions.shape[0]
        and query.shape[0] > 0
        and query.device == key.device == positions.device == inv_freq.device
        and inv_freq.dtype == torch.float32
        and inv_freq.dim() == 1
        and inv_freq.is_contiguous()
        and 0 < 2 * inv_freq.numel() <= head_size
        and _weight_ok(q_weight, query, head_size, gemma)
        and _weight_ok(k_weight, query, head_size, gemma)
        and _heads_view(query, head_size) is not None
        and _heads_view(key, head_size) is not None
    )


def qk_norm_rotary_(
    positions: torch.Tensor,  # [T] int
    query: torch.Tensor,  # [T, Hq*D] or [T, Hq, D], last dim contiguous; normalized and rotated in place
    key: torch.Tensor,  # [T, Hkv*D] or [T, Hkv, D], likewise
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    q_eps: float,
    k_eps: float,
    inv_freq: torch.Tensor,  # [R/2] float32, contiguous
    head_size: int,
    attention_scaling: float = 1.0,
    gemma: bool = False,
    cache: KVCacheWrite | None = None,  # also store the keys and values into the paged cache
) -> tuple[torch.Tensor, torch.Tensor]:  # (query, key), the same tensors
    sqt, sqh, hq = _heads_view(query, head_size)
    skt, skh, hk = _heads_view(key, head_size)
    half = inv_freq.numel()
    half_p2 = triton.next_power_of_2(half)
    rest = head_size - 2 * half
    rest_p2 = triton.next_power_of_2(rest) if rest > 0 else 1
    # ~1K head elements per program: 8 heads of 128, 4 of 256; small enough that decode steps get
    # many programs, large enough that prefill does not drown in tiny ones.
    block_h = max(1, min(triton.next_power_of_2(max(hq, hk)), 1024 // triton.next_power_of_2(head_size)))
    num_q_blocks = triton.cdiv(hq, block_h)
    grid = (query.shape[0], num_q_blocks + triton.cdiv(hk, block_h))
    if cache is not None:
        assert cache_write_usable(cache, key, head_size), "the cache write needs a [T, Hkv, D] value view and a paged cache"
        svt, svh, _ = _heads_view(cache.value, head_size)
        kc, vc = cache.k_cache, cache.v_cache
        cache_args = (cache.value, svt, svh, kc, vc, cache.slot_mapping, kc.stride(0), kc.stride(1), kc.stride(2))
        block_size = kc.shape[1]
    else:
        cache_args = (query, 0, 0, query, query, positions, 0, 0, 0)
        block_size = 1
    _qk_norm_rotary_kernel[grid](
        positions, inv_freq, query, key, q_weight, k_weight,
        hq, hk, sqt, sqh, skt, skh,
        float(q_eps), float(k_eps), head_size, half, float(attention_scaling), num_q_blocks,
        *cache_args,
        GEMMA=gemma, HAS_REST=rest > 0, HALF_P2=half_p2, REST_P2=rest_p2, BLOCK_H=block_h, EXACT=exact_rounding(query),
        WRITE_CACHE=cache is not None, BLOCK_SIZE=block_size, D_P2=triton.next_power_of_2(head_size),
        num_warps=4, **pdl_launch_args(query),
    )
    return query, key


class KVCacheWrite(NamedTuple):
    """Where ``qk_norm_rotary_`` also stores a step's keys (as finished) and values: reshape_and_cache's arguments."""

    value: torch.Tensor  # [T, Hkv*D] or [T, Hkv, D], last dim contiguous
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], the same strides
    slot_mapping: torch.Tensor  # [>= T] int64; negative entries (padding) are skipped


def cache_write_usable(cache: KVCacheWrite, key: torch.Tensor, head_size: int) -> bool:
    """Whether the launch can store into ``cache`` for this ``key`` (else the attention backend writes)."""
    kc, vc = cache.k_cache, cache.v_cache
    view = _heads_view(cache.value, head_size)
    return (
        view is not None
        and view[2] == _heads_view(key, head_size)[2]
        and cache.value.shape[0] == key.shape[0]
        and kc.dim() == 4
        and kc.shape == vc.shape
        and kc.stride() == vc.stride()
        and kc.stride(-1) == 1
        and kc.shape[2] == view[2]
        and kc.shape[3] == head_size
        and kc.device == key.device
        and cache.slot_mapping.dtype == torch.int64
        and cache.slot_mapping.shape[0] >= key.shape[0]
    )
