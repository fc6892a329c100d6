"""The Triton attention backend: fused cache write plus one paged-attention kernel over a mixed batch."""
from __future__ import annotations

import torch
import triton

from pagedllm.attention.backend import AttentionBackend, AttentionImpl, QKTransform
from pagedllm.kernels import qk_norm_rotary as qk_kernel
from pagedllm.kernels.attention import decode_pieces as pieces_kernel
from pagedllm.kernels.attention.fused_inputs import ChunkKV, NewKV, Rope
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

    Pure-decode steps store the new K/V inside the attention launch (or find them written by the q/k
    norm + rotary launch, see ``forward_qk``) and take requests longest context first when the metadata
    gives that order. Other steps read the step's own keys from its key/value rows instead of through the
    block table: the same values, and prompt attention 10-15% faster on an H200.
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
        *,
        rope: Rope | None = None,  # pure decode only: query and key arrive unrotated, the launch rotates them
        kv_written: bool = False,  # the cache already holds this step's K/V (the q/k norm + rotary launch)
    ) -> torch.Tensor:  # [T_padded, Hq, D]
        md = attn_metadata
        num_tokens = md.num_actual_tokens
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if rope is not None and (md.max_query_len != 1 or kv_written):
            raise ValueError("the rotary embedding is fused only into pure-decode launches that store the new K/V")
        new_kv = chunk_kv = None
        if md.max_query_len == 1 and not kv_written:
            new_kv = NewKV(key, value, md.slot_mapping)
        else:
            if not kv_written:
                reshape_and_cache(key[:num_tokens], value[:num_tokens], k_cache, v_cache, md.slot_mapping[:num_tokens])
            if md.max_query_len > 1 and key.dtype == k_cache.dtype:
                chunk_kv = ChunkKV(key, value)

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

    def forward_qk(
        self,
        positions: torch.Tensor,  # [T_padded] int64
        query: torch.Tensor,  # [T_padded, Hq, D]
        key: torch.Tensor,  # [T_padded, Hkv, D]
        value: torch.Tensor,  # [T_padded, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
        qk: QKTransform,
    ) -> torch.Tensor:  # [T_padded, Hq, D]
        md = attn_metadata
        if qk.rope is not None and qk.q_norm is None and qk.k_norm is None and md.max_query_len == 1:
            # Pure decode without q/k norms: the attention launch rotates q and the new key in registers
            # (at seq_len - 1, each decode token's position) as it stores the key, saving the rotary launch
            # of every layer.
            return self.forward(query, key, value, kv_cache, md, rope=qk.rope)
        rope, norm = qk.rope, qk.norm
        if rope is not None and norm is not None and qk_kernel.usable(
            positions, query, key, norm.q_weight, norm.k_weight, rope.inv_freq, self.head_size, True, norm.gemma
        ):
            # One launch normalises and rotates q and k in place (instead of two norm launches writing
            # copies and a rotary launch over them) and stores the finished keys and the values in the
            # cache, so that attention only reads it: one launch a layer less in prompt steps, and no
            # write before a barrier in decode.
            cache = qk_kernel.KVCacheWrite(value, kv_cache[0], kv_cache[1], md.slot_mapping)
            if not qk_kernel.cache_write_usable(cache, key, self.head_size):
                cache = None
            query, key = qk_kernel.qk_norm_rotary_(
                positions, query, key, norm.q_weight, norm.k_weight, norm.q_eps, norm.k_eps, rope.inv_freq,
                self.head_size, rope.scaling, gemma=norm.gemma, cache=cache,
            )
            return self.forward(query, key, value, kv_cache, md, kv_written=cache is not None)
        return super().forward_qk(positions, query, key, value, kv_cache, md, qk)

    def _uses_pieces(self, md: AttentionMetadata, query: torch.Tensor, k_cache: torch.Tensor) -> bool:
        if md.max_query_len != 1 or self.sliding_window is not None or k_cache.element_size() != 1:
            return False
        # One-warp programs over a float8 cache are latency-bound: a program on a long context cannot
        # speed up when others finish, so a ragged batch leaves slots idle unless its work is cut evenly.
        programs = md.num_reqs * k_cache.shape[2]
        return (triton.next_power_of_2(self.head_size) <= 128
                and programs >= _PIECES_MIN_PROGRAMS_PER_SM * device_sm_count(query.device))

    def _decode_in_pieces(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                          out: torch.Tensor, new_kv: NewKV | None, rope: Rope | None) -> torch.Tensor:
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
