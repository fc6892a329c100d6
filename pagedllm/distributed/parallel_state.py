"""The process groups of one engine's workers: world, tensor-parallel, pipeline-parallel and expert-parallel.

Within one engine core, rank ``r`` of its ``tp * pp`` ranks is tensor rank ``r % tp`` of pipeline stage
``r // tp``: a stage's tensor-parallel ranks are neighbours, and a pipeline group joins the ranks of one
tensor rank across stages. With expert parallelism a stage's ranks split its MoE layers' experts between
them instead of each expert's rows: the expert-parallel group is the tensor-parallel group. Under data
parallelism with expert parallelism the K cores' ranks join one world of ``K * tp * pp`` (core ``d``'s rank
``r`` is global rank ``d * tp * pp + r``); tensor and pipeline groups stay within a core, and the
expert-parallel group of a stage joins that stage's ranks of every core, core by core (``K * tp`` ranks).
Before ``init_model_parallel`` (one process, no torch.distributed) every group is a group of one whose
collectives return their input, so layers call them unconditionally.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class GroupCoordinator:
    """One process group seen from one rank: its members (global ranks) and its collectives."""

    def __init__(self, ranks: list[int], rank: int, device_group: dist.ProcessGroup | None) -> None:
        self.ranks = ranks
        self.rank = rank  # this process's global rank
        self.rank_in_group = ranks.index(rank)
        self.world_size = len(ranks)
        self.device_group = device_group

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next member (wrapping)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # sums in place over the group; returns x
        if self.world_size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:  # [..., n, ...] -> [..., n * world, ...]
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """The members' ``x`` concatenated along ``dim`` on member ``dst``; None on the others."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank_in_group == dst else None
        dist.gather(x, parts, dst=self.ranks[dst], group=self.device_group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of ``x`` [sum(send_counts), ...] sent in runs to the members in order; returns the rows received
        [sum(recv_counts), ...], the members' runs in member order."""
        if self.world_size == 1:
            return x
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.device_group)
        return out

    def send(self, x: torch.Tensor, dst_global: int) -> None:
        dist.send(x.contiguous(), dst=dst_global, group=self.device_group)

    def recv(self, x: torch.Tensor, src_global: int) -> torch.Tensor:
        dist.recv(x, src=src_global, group=self.device_group)
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.device_group)

    def __repr__(self) -> str:
        return f"GroupCoordinator(ranks={self.ranks}, rank={self.rank})"


_SINGLE = GroupCoordinator([0], 0, None)
_TP: GroupCoordinator = _SINGLE
_PP: GroupCoordinator = _SINGLE
_WORLD: GroupCoordinator = _SINGLE
_EP: GroupCoordinator = _SINGLE


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def get_world_group() -> GroupCoordinator:
    return _WORLD


def get_ep_group() -> GroupCoordinator:
    """The ranks that split a MoE layer's experts: under expert parallelism the tensor-parallel group, or with
    data parallelism that stage's tensor ranks of every core; else one."""
    return _EP


def init_model_parallel(
    tensor_parallel_size: int, pipeline_parallel_size: int, rank: int, init_method: str, backend: str = "gloo",
    timeout_s: float = 600.0, enable_expert_parallel: bool = False, data_parallel_size: int = 1,
    data_parallel_rank: int = 0,
) -> None:
    """Joins the world at ``init_method`` (e.g. ``tcp://127.0.0.1:PORT``) and builds the groups; ``rank`` is
    the rank within its engine core. ``data_parallel_size`` K > 1 (expert parallelism across the cores): the
    world holds every core's ranks, core ``data_parallel_rank``'s from ``data_parallel_rank * tp * pp`` on.
    Every rank of the world must call it: each ``new_group`` is itself a collective over the whole world."""
    import datetime

    global _TP, _PP, _WORLD, _EP
    tp, pp, dp = tensor_parallel_size, pipeline_parallel_size, data_parallel_size
    per_core = tp * pp
    world = dp * per_core
    if not 0 <= rank < per_core:
        raise ValueError(f"rank {rank} is outside a core of {per_core} ranks (tensor {tp} x pipeline {pp})")
    if not 0 <= data_parallel_rank < dp:
        raise ValueError(f"data_parallel_rank {data_parallel_rank} is outside data_parallel_size {dp}")
    if dp > 1 and not enable_expert_parallel:
        raise ValueError("data-parallel cores share a world only to split experts (enable_expert_parallel)")
    if world == 1:
        return
    rank = data_parallel_rank * per_core + rank  # global from here on
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank,
                                timeout=datetime.timedelta(seconds=timeout_s))
    _WORLD = GroupCoordinator(list(range(world)), rank, dist.group.WORLD)
    # Every rank creates every group, in the same order (new_group is a collective of the whole world).
    for core in range(dp):
        base = core * per_core
        for stage in range(pp):
            ranks = list(range(base + stage * tp, base + (stage + 1) * tp))
            group = dist.new_group(ranks) if tp > 1 else None
            if rank in ranks:
                _TP = GroupCoordinator(ranks, rank, group)
        for tp_rank in range(tp):
            ranks = list(range(base + tp_rank, base + per_core, tp))
            group = dist.new_group(ranks) if pp > 1 else None
            if rank in ranks:
                _PP = GroupCoordinator(ranks, rank, group)
    if enable_expert_parallel and dp == 1:
        _EP = _TP
    elif enable_expert_parallel:
        for stage in range(pp):
            # Core by core, each core's tensor ranks in order: expert-parallel rank d * tp + t.
            ranks = [core * per_core + stage * tp + t for core in range(dp) for t in range(tp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                _EP = GroupCoordinator(ranks, rank, group)


def destroy_model_parallel() -> None:
    global _TP, _PP, _WORLD, _EP
    _TP = _PP = _WORLD = _EP = _SINGLE
    if dist.is_initialized():
        dist.destroy_process_group()
