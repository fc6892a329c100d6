"""Tile configurations of the grouped MoE GEMMs, chosen by the step's rows per expert.

Few rows per expert (decode) is a weight-streaming problem: short ``BLOCK_M`` so that padding wastes
little, long ``BLOCK_K`` for long contiguous weight reads. Many rows (prefill) is a compute problem:
square tiles with more warps. Float32 halves ``BLOCK_K`` to stay within registers.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re

import torch

# Tuned tables written by ``benchmarks/moe_kernels.py --sweep --write``: one JSON file per device name, holding
# for each layer shape ("E=<experts>,N=<intermediate>,K=<hidden>") the best config at each token count measured.
TUNED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")

# (largest average rows per expert, config); the last row takes every larger step.
_TABLE: tuple[tuple[int, dict[str, int]], ...] = (
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)),
    (64, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=3)),
    (256, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)),
    (1 << 62, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)),
)

# Block-wise float8 experts past 32 rows an expert: the kernel's K step is the 128-deep scale block and each step's
# dot is scaled before it joins the accumulator, so the 16-bit table's 128x128 prefill tile (two float32
# accumulators and a scaled dot per program) spills. One H100 sweep (moe_kernels, 24 tiles): 64 rows an expert
# 64x64 (Mixtral 692 against 976 µs), 256 rows 64x64 (1,618 against 1,961), 1,024 rows 64x128 on 8 warps
# (6,149 against 12,286).
_BLOCK_FP8_TABLE: tuple[tuple[int, dict[str, int]], ...] = (
    (512, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)),
    (1 << 62, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)),
)
_BLOCK_FP8_FROM_ROWS = 32


def device_file_name(device_name: str) -> str:
    """``"NVIDIA H200"`` -> ``"NVIDIA_H200.json"``: the tuned table's file for a device."""
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json"


def shape_key(num_experts: int, intermediate: int, hidden: int) -> str:
    return f"E={num_experts},N={intermediate},K={hidden}"


@functools.cache
def _tuned_table(device_name: str) -> dict[str, list[tuple[int, dict[str, int]]]]:
    path = os.path.join(TUNED_DIR, device_file_name(device_name))
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        shapes = json.load(f)["shapes"]
    return {key: sorted((int(tokens), config) for tokens, config in rows.items()) for key, rows in shapes.items()}


# A tuned config stands for token counts within this factor of the count it was tuned at; past it (a sweep
# limited to a few counts) the rows-per-expert table decides: a decode tile must not run a prefill.
TUNED_REACH = 4


def nearest_tuned(
    rows: list[tuple[int, dict[str, int]]] | None,  # (token count, config), as a tuned table holds them
    num_tokens: int,
) -> dict[str, int] | None:
    """The config tuned at the token count nearest ``num_tokens`` (by ratio), if within ``TUNED_REACH``."""
    if not rows:
        return None
    tokens, config = min(rows, key=lambda r: abs(math.log2(r[0] / max(num_tokens, 1))))
    if abs(math.log2(tokens / max(num_tokens, 1))) > math.log2(TUNED_REACH):
        return None
    return dict(config)


def get_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype,
               shape: tuple[int, int] | None = None, block_fp8: bool = False) -> dict[str, int]:
    """The launch configuration for ``num_tokens`` tokens routed to ``top_k`` of ``num_experts`` experts.

    ``shape`` (intermediate, hidden): with it, a 16-bit step on a CUDA device whose tuned table holds this layer
    takes the config tuned at the nearest token count (by ratio, within ``TUNED_REACH``); otherwise the
    rows-per-expert table above (``block_fp8``: block-wise float8 experts' own table past 32 rows an expert)."""
    if shape is not None and dtype != torch.float32 and torch.cuda.is_available():
        config = nearest_tuned(_tuned_table(torch.cuda.get_device_name()).get(shape_key(num_experts, *shape)),
                               num_tokens)
        if config is not None:
            return config
    rows_per_expert = num_tokens * top_k / num_experts
    if block_fp8 and rows_per_expert > _BLOCK_FP8_FROM_ROWS:
        return dict(next(c for bound, c in _BLOCK_FP8_TABLE if rows_per_expert <= bound))
    config = next(c for bound, c in _TABLE if rows_per_expert <= bound)
    if dtype == torch.float32:
        config = {**config, "BLOCK_K": min(config["BLOCK_K"], 32), "num_stages": 2}
    return dict(config)
