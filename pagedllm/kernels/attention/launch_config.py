"""Launch choices of the paged-attention kernel: tile shapes and split-KV partition counts, from host-side batch facts."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

# Split-KV tuning, from H200 timings of 32q/8kv D=128 decode: a lone program streams one tile per
# ~2 us, so bandwidth needs several resident programs per SM. Split only when (requests x KV heads)
# leaves SMs idle (< _SPLIT_BELOW_PROGRAMS_PER_SM per SM: at 1.9 per SM one pass still beat five
# partitions plus their reduction, 74% against 66% of the copy rate), then cut contexts until about
# _SPLIT_PROGRAMS_PER_SM programs per SM exist, at most one piece per _MIN_SPLIT_LEN keys of the
# longest context, and at most _MAX_SPLITS pieces so the partial-result scratch stays small.
# The kernel cuts each request's own context into that many tile-aligned pieces, so a CUDA graph
# captured for the longest context still splits a short one finely.
_SPLIT_BELOW_PROGRAMS_PER_SM = 1
_SPLIT_PROGRAMS_PER_SM = 8
_MIN_SPLIT_LEN = 64
_MAX_SPLITS = 64


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the attention kernel; ``block_m`` counts (query token, query head) rows."""

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    # A cap on registers per thread (ptxas), so that more programs fit on an SM; None: the compiler's choice.
    max_regs: int | None = None


def default_config(
    head_size: int,
    group: int,
    max_query_len: int,
    *,
    max_seq_len: int = 0,
    num_reqs: int = 1,
    num_kv_heads: int = 1,
    num_sms: int = 132,
    split: bool = False,
    cache_bytes: int = 2,
) -> KernelConfig:
    """Tile shape from host-side batch facts only, so picking it never waits on the device.

    Decode choices come from H200 sweeps (16q/8kv and 32q/8kv, D=128, bf16, contexts 640-1500) of the
    one-program-per-request decode launch: decode is bandwidth-bound, and 64-key tiles beat 32 and 128
    from 64 to 256 requests (87-98% of the copy rate at 256); 4 warps win when programs are many
    (>= 12 per SM), 2 below that. The choice depends on no context length, so a CUDA graph captured
    for the longest context launches what an eager step of the same batch would.
    Prefill: 64 rows x 64 keys, 4 warps, 2 stages beat 128-row tiles on a 4k-token prompt.
    Over a float8 cache (``cache_bytes`` 1) the decode kernel is bound by the latency of its instructions
    (widening each tile for the products), not by memory. One warp a program with 32-key tiles streams
    fastest wherever programs are many (>= 6 an SM): no cross-warp reductions or barriers in the tile
    loop (H200, 16q/8kv: 2.9-3.3 TB/s at 128-256 requests against 2.2-2.6 with 2 or 4 warps). Fewer
    programs keep the 16-bit choices; with one warp, a split batch-1 decode was slower.
    """
    head_size_p2 = triton.next_power_of_2(head_size)
    group_p2 = triton.next_power_of_2(group)
    if max_query_len == 1:
        # One token per request: the group's heads fill the rows, padded to the tensor-core minimum.
        block_m = max(16, group_p2)
        tile_n = 32 if head_size_p2 > 128 else 64
        programs = num_reqs * num_kv_heads
        if cache_bytes == 1 and head_size_p2 <= 128 and not split and programs >= 6 * num_sms:
            return KernelConfig(block_m=block_m, tile_n=32, num_warps=1, num_stages=2)
        many = programs >= 12 * num_sms
        return KernelConfig(block_m=block_m, tile_n=tile_n, num_warps=4 if split or many else 2, num_stages=2)
    # Enough rows for the longest query run of one request; tensor cores need M >= 16.
    block_m = max(min(max(triton.next_power_of_2(max_query_len) * group_p2, 16), 64), group_p2)
    tile_n = 64 if head_size_p2 <= 128 else 32
    return KernelConfig(block_m=block_m, tile_n=tile_n, num_warps=4, num_stages=2)


def choose_num_splits(
    num_reqs: int,
    max_query_len: int,
    max_seq_len: int,
    num_kv_heads: int,
    num_sms: int,
) -> int:
    """Partitions per context for the split-KV path; 1 means the single-pass kernel.

    Only pure-decode batches split: a prefill chunk already brings many programs. Decode gives one
    program per (request, KV head); too few of those leave SMs idle and each resident one
    latency-bound, so long contexts are cut until the GPU holds several programs per SM.
    """
    if max_query_len != 1:
        return 1
    programs = num_reqs * num_kv_heads
    if programs >= _SPLIT_BELOW_PROGRAMS_PER_SM * num_sms:
        return 1
    by_occupancy = triton.cdiv(_SPLIT_PROGRAMS_PER_SM * num_sms, programs)
    by_length = max(1, max_seq_len // _MIN_SPLIT_LEN)
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def pieces_config(head_size: int, group: int) -> KernelConfig:
    """Launch shape of decode pieces: the one-warp, 32-key program that streams a float8 cache fastest."""
    return KernelConfig(block_m=max(16, triton.next_power_of_2(group)),
                        tile_n=32 if triton.next_power_of_2(head_size) <= 128 else 16, num_warps=1, num_stages=2)


def pieces_programs(num_sms: int, num_kv_heads: int, num_warps: int, warps_per_sm: int = 8) -> int:
    """Persistent programs per KV head of a decode-pieces launch, ``warps_per_sm`` warps an SM in all: 8
    one-warp programs are what fit of the float8 decode program (252 registers a thread on an H200), and
    on a ragged batch they beat 16 (an SM's second set finding little left) by 0-17%."""
    return max(1, triton.cdiv(num_sms * max(1, warps_per_sm // num_warps), num_kv_heads))


def device_sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    # The CPU interpreter has no SMs; pretend a mid-size GPU so the heuristic stays exercisable.
    return 64
