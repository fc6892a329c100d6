"""The MoE router: each token's top-k experts and their weights from the router logits, in float32."""
from __future__ import annotations

import torch


def select_experts(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [T, K] float32, expert ids [T, K] int32)
    """Softmax over the experts in float32, then the ``top_k`` largest, highest first.

    With ``renormalize`` the chosen weights are divided by their sum (Mixtral, Qwen3-MoE's
    ``norm_topk_prob``); without, they keep their share of the whole softmax (Qwen2-MoE).
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}] (the number of experts); got {top_k}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
