"""Forward passes that are not steps: compiling kernel variants before serving, and measuring activation memory.

Each takes the ``ModelRunner`` whose model, buffers and KV caches it uses (not imported: the runner imports this)."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.worker.input_batch import BatchInputs

@torch.inference_mode()
def warm_up_kernels(runner: Any) -> None:
    """Compiles the mixed-batch kernels' variants (one per class of longest query run) now, rather than
    inside the first steps that need them: one tiny single-request step per power of two up to 64.

    The steps write no KV (padding slots) and read block 0, whatever it holds; outputs are dropped.
    """
    bs = runner.block_size
    for q_len in (2, 4, 8, 16, 32, 64):
        if q_len > min(runner.max_model_len, runner.buffers.max_tokens):
            break
        b = BatchInputs(
            req_ids=["warm-up"],
            input_ids=np.zeros(q_len, dtype=np.int64),
            positions=np.arange(q_len, dtype=np.int64),
            slot_mapping=np.full(q_len, -1, dtype=np.int64),
            query_start_loc=np.array([0, q_len], dtype=np.int32),
            seq_lens=np.array([q_len], dtype=np.int32),
            block_table=np.zeros((1, -(-q_len // bs)), dtype=np.int32),
            logits_indices=np.array([q_len - 1], dtype=np.int64),
            logits_reqs=np.zeros(1, dtype=np.int64),
            max_query_len=q_len,
            max_seq_len=q_len,
            pending_dst=np.zeros(0, dtype=np.int64),
        )
        fwd = runner._forward(b, None)
        row = 0 if fwd.per_request else q_len - 1
        if runner.is_last_stage:
            runner.model.compute_logits(fwd.hidden[row : row + 1])
    if runner.device.type == "cuda":
        torch.cuda.synchronize()

@torch.inference_mode()
def profile_run(runner: Any, num_tokens: int) -> None:
    """One forward pass over ``num_tokens`` prompt tokens without a KV cache, to measure activations."""
    mc = runner.model_config
    n_blocks = -(-num_tokens // runner.block_size)
    shape = runner.attn_backend.get_kv_cache_shape(n_blocks, runner.block_size, runner.num_kv_heads, mc.head_size)
    dtype = runner.config.kv_cache_dtype
    caches = [torch.zeros(shape, dtype=dtype, device=runner.device) for _ in range(runner.layer_end - runner.layer_start)]
    md = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=1,
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=runner.device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=runner.device),
        block_table=torch.arange(n_blocks, dtype=torch.int32, device=runner.device)[None],
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=runner.device),
        query_start_loc_cpu=[0, num_tokens],
        seq_lens_cpu=[num_tokens],
    )
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=runner.device)
    pos = torch.arange(num_tokens, device=runner.device)
    kv_caches, runner.kv_caches = runner.kv_caches, caches
    try:
        hidden = runner._stage_forward(ids, pos, md, None)
    finally:
        runner.kv_caches = kv_caches
    if runner.is_last_stage:
        runner.model.compute_logits(hidden[-min(num_tokens, runner.max_num_seqs) :])
    del caches
