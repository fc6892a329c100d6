"""Activation rows handed to a quantized linear already quantized by the kernel that produced them (a norm or a
gated activation), and the jit helpers those kernels quantize a row with: float8 (``fp8_quant.py``'s arithmetic)
or symmetric int8 (``int8_quant.py``'s).

A float8 or W8A8 int8 linear quantizes its input per row right before its product. Where one kernel alone
produces that input, it can store the quantized row and its scale instead of the 16-bit row: the quantizer's
launch (or, for one int8 row, every program of the product repeating the row's reduction and divisions) and a
write and two reads of the 16-bit rows are saved. The bits are the consumer's own: the producer rounds its
output to the 16-bit type first, then quantizes it with the consumer's helpers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.kernels import fp8_quant, int8_quant

# The ``QUANT`` constexpr of the producing kernels: 0 stores the 16-bit row.
KINDS = {"fp8": 1, "int8": 2}
_QDTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


@dataclass(frozen=True)
class QuantizedRows:
    """Rows quantized by their producer, in place of the 16-bit rows a linear takes."""

    q: torch.Tensor  # [T, K] float8_e4m3fn or int8
    scales: torch.Tensor  # [T, 1] float32
    dtype: torch.dtype  # the 16-bit (or float32) type the rows had, which the product returns

    # What model code may ask of the rows it passes on (e.g. Gemma 3's MLP block checks the device).
    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def is_cuda(self) -> bool:
        return self.q.is_cuda

    @property
    def kind(self) -> str:
        return "int8" if self.q.dtype == torch.int8 else "fp8"


def empty_rows(kind: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> QuantizedRows:
    """Room for ``rows`` quantized rows of ``cols`` values of ``kind`` ("fp8" or "int8")."""
    return QuantizedRows(torch.empty((rows, cols), dtype=_QDTYPES[kind], device=device),
                         torch.empty((rows, 1), dtype=torch.float32, device=device), dtype)


@triton.jit
def scale_of(amax, KIND: tl.constexpr, EXACT: tl.constexpr):
    """The scale of a row whose largest magnitude is ``amax`` (float32), as the consumer's quantizer computes it
    (``EXACT``: compiled NVIDIA code, where int8's quantizer multiplies by the reciprocal as torch on CUDA does)."""
    if KIND == 1:
        return fp8_quant.row_scale(amax)
    else:
        return int8_quant.row_scale(amax, EXACT, EXACT)


@triton.jit
def quantized(x, scale, KIND: tl.constexpr, EXACT: tl.constexpr):
    """float32 ``x`` over its row's ``scale``: float8-range values (the cast to float8 rounds them) or int8."""
    if KIND == 1:
        return fp8_quant.to_fp8_range(x, scale)
    else:
        return int8_quant.quantize_int8(x, scale, EXACT)


@triton.jit
def quantize_row(o, mask, KIND: tl.constexpr, EXACT: tl.constexpr):
    """(values to store, scale) of one row held whole in float32 ``o`` (already rounded to its 16-bit type)."""
    scale = scale_of(tl.max(tl.where(mask, tl.abs(o), 0.0), axis=0), KIND, EXACT)
    return quantized(o, scale, KIND, EXACT), scale
