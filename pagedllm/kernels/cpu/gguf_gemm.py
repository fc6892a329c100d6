"""Matrix products with GGUF-quantized weights kept packed on the CPU: ``x @ W.T`` where W stays in ggml blocks.

Contract (callers in layers/ depend on exactly this):
- ``KERNEL_TYPES``: ggml type ids the kernel reads packed (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K).
- ``available()``: whether the kernel can run here; callers keep weights dense when it cannot.
- ``gguf_mm(x, qweight, qtype)``: x [M, K] float32, qweight [N, K // block * type_size] uint8 rows of blocks
  -> [M, N] float32.
- ``gguf_dequantize(qweight, qtype)``: [N, row_bytes] uint8 -> [N, K] float32 (for row gathers: embeddings).
"""
from __future__ import annotations

import numpy as np
import torch

# ggml type id -> (elements per block, bytes per block)
BLOCKS: dict[int, tuple[int, int]] = {2: (32, 18), 6: (32, 22), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
KERNEL_TYPES: frozenset[int] = frozenset(BLOCKS)


def available() -> bool:
    return True


def gguf_dequantize(qweight: torch.Tensor, qtype: int) -> torch.Tensor:  # [N, row_bytes] u8 -> [N, K] f32
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    out = dequantize(qweight.contiguous().numpy(), GGMLQuantizationType(int(qtype)))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def gguf_mm(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> torch.Tensor:  # [M, K] f32 -> [M, N] f32
    return x @ gguf_dequantize(qweight, qtype).t()
