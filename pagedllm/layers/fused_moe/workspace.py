"""The scratch memory one MoE layer's fused experts take at a token count: what start-up reserves for it.

Layers run one after another and free their scratch, so a model needs the largest layer's, not the sum.
The count follows ``kernels/moe/fused_moe.py``: the aligned pair ids (at most ``max_padded_pairs`` at the
smallest row block, the largest layout) and their expert ids, the gated intermediate [T*K, I], the down
projection's rows [T*K, H] before the top-k sum, and that sum [T, H].
"""
from __future__ import annotations

import torch
from torch import nn

# The smallest BLOCK_M the config tables use: the most padding per expert in use.
_MIN_BLOCK_M = 16


def moe_workspace_bytes(
    num_tokens: int, top_k: int, num_experts: int, intermediate: int, hidden: int, dtype: torch.dtype
) -> int:
    """Bytes of one fused-experts call over ``num_tokens`` tokens (``intermediate``: this rank's share)."""
    from pagedllm.kernels.moe.align import max_padded_pairs

    if num_tokens < 0 or top_k < 1 or num_experts < 1:
        raise ValueError(f"moe workspace needs num_tokens >= 0, top_k >= 1, num_experts >= 1; got {num_tokens}, "
                         f"{top_k}, {num_experts}")
    pairs = num_tokens * top_k
    padded = max_padded_pairs(pairs, num_experts, _MIN_BLOCK_M)
    item = torch.empty((), dtype=dtype).element_size()
    ids = 4 * (padded + padded // _MIN_BLOCK_M + 1)  # int32 sorted ids, block expert ids, padded count
    return ids + item * (pairs * intermediate + pairs * hidden + num_tokens * hidden)


def model_moe_workspace_bytes(model: nn.Module, num_tokens: int) -> int:
    """The largest MoE layer's workspace in ``model`` at ``num_tokens`` tokens; 0 without MoE layers."""
    from pagedllm.layers.fused_moe.layer import MoEExperts

    best = 0
    for m in model.modules():
        if isinstance(m, MoEExperts):
            # act_dtype: the activations' type, the model's even when the experts are float8.
            best = max(best, moe_workspace_bytes(num_tokens, m.top_k, m.num_local_experts,
                                                 m.intermediate_size_per_partition, m.hidden_size, m.act_dtype))
    return best
