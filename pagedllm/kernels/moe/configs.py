"""Tile configurations of the grouped MoE GEMMs, chosen by the step's rows per expert.

Few rows per expert (decode) is a weight-streaming problem: short ``BLOCK_M`` so that padding wastes
little, long ``BLOCK_K`` for long contiguous weight reads. Many rows (prefill) is a compute problem:
square tiles with more warps. Float32 halves ``BLOCK_K`` to stay within registers.
"""
from __future__ import annotations

import torch

# (largest average rows per expert, config); the last row takes every larger step.
_TABLE: tuple[tuple[int, dict[str, int]], ...] = (
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)),
    (64, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=3)),
    (256, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)),
    (1 << 62, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)),
)


def get_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> dict[str, int]:
    """The launch configuration for ``num_tokens`` tokens routed to ``top_k`` of ``num_experts`` experts."""
    rows_per_expert = num_tokens * top_k / num_experts
    config = next(c for bound, c in _TABLE if rows_per_expert <= bound)
    if dtype == torch.float32:
        config = {**config, "BLOCK_K": min(config["BLOCK_K"], 32), "num_stages": 2}
    return dict(config)
