"""Triton kernel that scatters a step's new K/V rows into the paged KV cache by slot mapping."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.launch import pdl_launch_args, wait_for_previous_kernel

# Elements one program moves per tensor; bounds registers while keeping each program's copy wide.
_MAX_TILE_ELEMS = 4096


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, Hkv, D], last dim contiguous
    value_ptr,  # [T, Hkv, D], last dim contiguous
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D], last dim contiguous
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D], last dim contiguous
    slot_mapping_ptr,  # [T] int64, block_id * BLOCK_SIZE + offset; < 0 means padding
    num_kv_heads,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kcb, stride_kcp, stride_kch,
    stride_vcb, stride_vcp, stride_vch,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_GDC: tl.constexpr,  # launched with PDL: wait for the previous kernel first (kernels/launch.py)
):
    wait_for_previous_kernel(USE_GDC, True)
    tok = tl.program_id(0)
    head_block = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    # Padding tokens (CUDA-graph filler, discarded rows) own no cache slot.
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, HEAD_SIZE_P2)  # [HEAD_SIZE_P2]
    mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_SIZE)[None, :]  # [BLOCK_H, HEAD_SIZE_P2]
    tok64 = tok.to(tl.int64)

    k = tl.load(key_ptr + tok64 * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + tok64 * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kcp + heads[:, None] * stride_kch + dims[None, :]
    v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vcp + heads[:, None] * stride_vch + dims[None, :]
    # The cache may hold a narrower dtype than the activations (fp16 for fp32 compute, float8). Through
    # float32, so that every source type takes one rounding (saturating for float8), as torch's cast does.
    tl.store(k_dst, k.to(tl.float32).to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(tl.float32).to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; negative entries are skipped
) -> None:
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    assert value.shape == key.shape and slot_mapping.shape[0] >= num_tokens
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    block_size = k_cache.shape[1]
    head_size_p2 = triton.next_power_of_2(head_size)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE_ELEMS // head_size_p2))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _reshape_and_cache_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        num_kv_heads,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_SIZE=head_size,
        HEAD_SIZE_P2=head_size_p2,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        num_warps=4 if block_h * head_size_p2 >= 1024 else 1,
        **pdl_launch_args(key),
    )
