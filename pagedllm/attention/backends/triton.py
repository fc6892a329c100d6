"""The Triton attention backend: fused cache write plus one paged-attention kernel over a mixed batch."""
from __future__ import annotations

import torch
import triton

from pagedllm.attention.backend import AttentionBackend, AttentionImpl
from pagedllm.kernels.attention import decode_pieces as pieces_kernel
from pagedllm.kernels.attention.launch_config import device_sm_count, pieces_config, pieces_programs
from pagedllm.kernels.attention.paged_attention import paged_attention
from pagedllm.kernels.attention.reshape_and_cache import reshape_and_cache
from pagedllm.attention.metadata import AttentionMetadata


# Float8 decode runs in even pieces from two (request, KV head) pairs an SM (decode_pieces.py): H200,
# workload 1 over a float8 cache 1.06-1.07x (29,737 and 30,252 against 28,153 and 28,194 tok/s), and
# from 264 pairs 29,501 against 29,135 tok/s from 792 (where the one-pass launch turns to one-warp
# programs). 16-bit caches never do: workload 1 over a bf16 cache ran at 0.81x with pieces, its
# bandwidth-bound programs already speeding up when their neighbours finish.
_PIECES_MIN_PROGRAMS_PER_SM = 2


class TritonImpl(AttentionImpl):
    """Same contract as the torch_ref backend; rows past ``num_actual_tokens`` come back as zeros.

    Pure-decode steps store the new K/V inside the attention launch (or take them as written by the
    caller's q/k norm + rotary launch, ``takes_written_kv``) and take requests longest context first when
    the metadata gives that order. Other steps read the step's own keys from its key/value rows instead
    of through the block table: the same values, and prompt attention 10-15% faster on an H200.
    """

    # None lets the kernel's heuristic pick; tests and benchmarks pin 1 or a partition count per instance.
    num_splits: int | None = None

    def forward(
        self,
        query: torch.Tensor,  # [T_padded, Hq, D]
        key: torch.Tensor,  # [T_padded, Hkv, D]
        value: torch.Tensor,  # [T_padded, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
        rotary=None,  # a RotaryEmbedding when fuses_decode_rotary said yes
        kv_written: bool = False,  # the cache already holds this step's K/V (takes_written_kv said yes)
    ) -> torch.Tensor:  # [T_padded, Hq, D]
        """``rotary``: query and key arrive unrotated and the kernel rotates them (see fuses_decode_rotary)."""
        md = attn_metadata
        num_tokens = md.num_actual_tokens
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        new_kv = rope = None
        if rotary is not None:
            if not self.fuses_decode_rotary(md, rotary):
                raise ValueError("the rotary embedding is fused only into pure-decode steps with the cache write")
            rope = (rotary.inv_freq, rotary.attention_scaling)
        if kv_written and rotary is not None:
            raise ValueError("rotary embedding in the attention launch needs the cache write there too")
        chunk_kv = None
        if md.max_query_len == 1 and not kv_written:
            new_kv = (key, value, md.slot_mapping)
        else:
            if not kv_written:
                reshape_and_cache(key[:num_tokens], value[:num_tokens], k_cache, v_cache, md.slot_mapping[:num_tokens])
            if md.max_query_len > 1 and key.dtype == k_cache.dtype:
                chunk_kv = (key, value)

        out = torch.empty_like(query)
        if query.shape[0] > num_tokens:
            # Padding rows (e.g. CUDA-graph filler) match the reference's zeros instead of garbage.
            out[num_tokens:].zero_()
        query = query[:num_tokens]
        if query.stride(-1) != 1:
            query = query.contiguous()
        if self._uses_pieces(md, query, k_cache):
            self._decode_in_pieces(query, k_cache, v_cache, md, out[:num_tokens], new_kv, rope)
            return out
        paged_attention(
            query,
            k_cache,
            v_cache,
            md.block_table,
            md.seq_lens,
            md.query_start_loc,
            num_reqs=md.num_reqs,
            max_query_len=md.max_query_len,
            max_seq_len=md.max_seq_len,
            scale=self.scale,
            sliding_window=self.sliding_window,
            soft_cap=self.logits_soft_cap,
            out=out[:num_tokens],
            num_splits=self.num_splits,
            new_kv=new_kv,
            rope=rope,
            decode_order=md.decode_order if md.max_query_len == 1 else None,
            chunk_kv=chunk_kv,
        )
        return out

    def _uses_pieces(self, md: AttentionMetadata, query: torch.Tensor, k_cache: torch.Tensor) -> bool:
        if md.max_query_len != 1 or self.sliding_window is not None or k_cache.element_size() != 1:
            return False
        # One-warp programs over a float8 cache are latency-bound: a program on a long context cannot
        # speed up when others finish, so a ragged batch leaves slots idle unless its work is cut evenly.
        programs = md.num_reqs * k_cache.shape[2]
        return (triton.next_power_of_2(self.head_size) <= 128
                and programs >= _PIECES_MIN_PROGRAMS_PER_SM * device_sm_count(query.device))

    def _decode_in_pieces(self, query, k_cache, v_cache, md, out, new_kv, rope) -> torch.Tensor:
        num_reqs, num_kv_heads = md.num_reqs, k_cache.shape[2]
        cfg = pieces_config(self.head_size, self.num_heads // num_kv_heads)
        programs = pieces_programs(device_sm_count(query.device), num_kv_heads, cfg.num_warps)
        order = md.decode_order
        # The piece boundaries depend on the step's batch alone: one launch serves every layer.
        key = ("decode_pieces", cfg.tile_n, order is not None)
        ends = md.step_cache.get(key)
        if ends is None:
            ends = md.step_cache[key] = pieces_kernel.piece_ends(md.seq_lens, order, num_reqs, cfg.tile_n, programs)
        return pieces_kernel.decode_pieces_attention(
            query, k_cache, v_cache, md.block_table, md.seq_lens, ends, out,
            num_reqs=num_reqs, scale=self.scale, block_m=cfg.block_m, tile_n=cfg.tile_n, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, programs_per_head=programs, soft_cap=self.logits_soft_cap,
            decode_order=order, new_kv=new_kv, rope=rope,
        )

    def fuses_decode_rotary(self, md: AttentionMetadata, rotary) -> bool:
        # A pure-decode step (whose cache write is fused) and a neox-style rotary embedding: the kernel
        # rotates q and the new key in registers, saving the rotary launch of every layer.
        return md.max_query_len == 1 and rotary.is_neox_style

    def takes_written_kv(self, md: AttentionMetadata) -> bool:
        return True


class TritonBackend(AttentionBackend):
    name = "triton"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonImpl

    @staticmethod
    def workspace_bytes(max_reqs: int, num_heads: int, num_kv_heads: int, head_size: int, cache_bytes: int) -> int:
        # Decode pieces keep their partial outputs and counters (float8 caches only, see _uses_pieces).
        if cache_bytes != 1:
            return 0
        return pieces_kernel.workspace_bytes(max_reqs, num_heads, num_kv_heads, head_size)

    @staticmethod
    def reserve_workspace(device: torch.device, max_reqs: int, num_heads: int, num_kv_heads: int, head_size: int,
                          cache_bytes: int) -> None:
        # At its largest once, so that warm-up passes of growing batches do not each leave one behind.
        if cache_bytes == 1:
            pieces_kernel.reserve(device, max_reqs, num_heads, num_kv_heads, head_size)
