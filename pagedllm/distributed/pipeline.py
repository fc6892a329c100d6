"""Pipeline stages: which contiguous layers a stage runs, and the tensors one stage hands the next."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.distributed.parallel_state import GroupCoordinator

# int64 header that precedes a stage's tensors: count, then per tensor its rank and dims (up to 4).
_HEADER = 16
_MAX_DIMS = 4


def stage_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers [start, end) of stage ``pp_rank``: an even split, the remainder going to the stages before
    the last (which also holds the final norm and the LM head)."""
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot be split over pipeline_parallel_size {pp_size} stages")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):
        sizes[-2 - i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


@dataclass
class IntermediateTensors:
    """What a stage that is not the last returns: the hidden states and the residual stream so far."""

    hidden_states: torch.Tensor  # [T, H]
    residual: torch.Tensor  # [T, H]

    def send(self, group: GroupCoordinator) -> None:
        """To the next stage, shapes first (a step's token count is known to both, but not a padded one)."""
        tensors = (self.hidden_states, self.residual)
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = len(tensors)
        for i, t in enumerate(tensors):
            header[1 + i * (1 + _MAX_DIMS)] = t.dim()
            header[2 + i * (1 + _MAX_DIMS): 2 + i * (1 + _MAX_DIMS) + t.dim()] = torch.tensor(t.shape)
        dst = group.next_rank
        group.send(header.to(self.hidden_states.device), dst)
        for t in tensors:
            group.send(t, dst)

    @classmethod
    def recv(cls, group: GroupCoordinator, dtype: torch.dtype, device: torch.device) -> IntermediateTensors:
        src = group.prev_rank
        header = group.recv(torch.empty(_HEADER, dtype=torch.int64, device=device), src).cpu()
        tensors = []
        for i in range(int(header[0])):
            ndim = int(header[1 + i * (1 + _MAX_DIMS)])
            shape = header[2 + i * (1 + _MAX_DIMS): 2 + i * (1 + _MAX_DIMS) + ndim].tolist()
            tensors.append(group.recv(torch.empty(shape, dtype=dtype, device=device), src))
        return cls(*tensors)
