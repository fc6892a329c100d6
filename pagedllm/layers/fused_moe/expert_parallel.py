"""Expert parallelism: a MoE layer's experts split between the ranks of a group, tokens sent to the rank that
holds each chosen expert and the results sent back, by two all-to-alls.

The tokens are replicated within a token group and differ between token groups: the tensor-parallel ranks
of a stage hold the same activations (the token group), and under data parallelism each engine core's
group holds its own requests' tokens, any number of them, zero included. The expert-parallel group is the
token groups one after the other. Each rank routes only its own contiguous slice of its token group's
tokens, so every (token, expert) pair is sent once; the slices' outputs are gathered within the token group
at the end, so that every rank leaves with its group's every token's output. The all-to-alls' sizes vary
per rank pair and are exchanged first.

Each rank computes its experts over the pairs it received in increasing token order (of the token groups'
tokens laid end to end, group by group), and each token's outputs are summed lowest expert id first: the
order of the one-rank reference over those tokens, so float32 results match it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.distributed.parallel_state import GroupCoordinator


def expert_parallel_experts(
    hidden_states: torch.Tensor,  # [T, H], the same on every rank of ``token_group``
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] global expert ids
    group: GroupCoordinator,
    num_local_experts: int,
    local_experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    token_group: GroupCoordinator | None = None,
) -> torch.Tensor:  # [T, H]
    """``local_experts(rows [R, H], weights [R, 1], local ids [R, 1]) -> [R, H]`` runs this rank's experts, each
    row already scaled by its routing weight. Rank r of ``group`` holds experts [r * num_local_experts,
    (r + 1) * ...). ``token_group``: the ranks holding this rank's tokens, a run of consecutive members of
    ``group`` (None: the whole group, whose ranks then all hold the same tokens). Every rank of ``group``
    must call this, with zero tokens if it has none."""
    token_group = group if token_group is None else token_group
    n = group.world_size
    tokens, top_k = topk_ids.shape
    per_rank = -(-tokens // token_group.world_size)
    me = token_group.rank_in_group
    start, end = min(me * per_rank, tokens), min((me + 1) * per_rank, tokens)

    # This rank's (token, slot) pairs, ordered by expert id (stable: increasing token within an expert), so the
    # runs per owner rank are contiguous and an owner receives each expert's rows in increasing token order.
    ids = topk_ids[start:end].reshape(-1).long()  # [P]
    order = torch.argsort(ids, stable=True)
    pair_ids = ids[order]
    pair_tokens = order // top_k  # token index within the slice
    owners = pair_ids // num_local_experts
    send_counts = torch.bincount(owners, minlength=n).tolist()  # one host sync: the all-to-all's sizes

    counts = torch.tensor(send_counts, dtype=torch.int64, device=hidden_states.device)
    recv_counts = group.all_to_all(counts, [1] * n, [1] * n).tolist()
    rows = group.all_to_all(hidden_states[start:end][pair_tokens], send_counts, recv_counts)  # [R, H]
    meta = torch.stack([pair_ids - owners * num_local_experts, pair_tokens], dim=1)  # [P, 2]: local id, token
    recv_meta = group.all_to_all(meta.to(torch.int64), send_counts, recv_counts)
    weights = topk_weights[start:end].reshape(-1)[order].float()
    recv_weights = group.all_to_all(weights, send_counts, recv_counts)  # [R]

    # The received runs come from the ranks in order, i.e. in increasing token order (token group by token
    # group); within one expert the rows must keep that order, so sort by local expert id stably.
    local_order = torch.argsort(recv_meta[:, 0], stable=True)
    out_local = torch.empty_like(rows)
    out_local[local_order] = local_experts(rows[local_order], recv_weights[local_order].unsqueeze(-1),
                                           recv_meta[local_order, :1])
    back = group.all_to_all(out_local, recv_counts, send_counts)  # [P, H], in this rank's pair order

    # Pairs are in increasing expert id; a sequential index_add per token sums its experts lowest id first.
    out_slice = torch.zeros(end - start, hidden_states.shape[1], dtype=hidden_states.dtype,
                            device=hidden_states.device)
    for chunk in _by_expert(pair_ids):
        out_slice.index_add_(0, pair_tokens[chunk], back[chunk].to(out_slice.dtype))
    padded = hidden_states.new_zeros(per_rank, hidden_states.shape[1])
    padded[: end - start] = out_slice
    return token_group.all_gather(padded, dim=0)[:tokens]


def _by_expert(sorted_ids: torch.Tensor) -> list[slice]:
    """The runs of equal expert id in ``sorted_ids``: each index_add then holds a token at most once, so the
    sum's order is the runs' order on every device."""
    if sorted_ids.numel() == 0:
        return []
    change = torch.nonzero(sorted_ids[1:] != sorted_ids[:-1]).flatten().add(1).tolist()
    bounds = [0, *change, sorted_ids.numel()]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
