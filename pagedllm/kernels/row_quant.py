"""Activation rows handed to a quantized linear already quantized by the kernel that produced them (a norm or a
gated activation), and the jit helpers those kernels quantize a row with: float8 (``fp8_quant.py``'s arithmetic)
or int8, symmetric or with a zero point per row (``int8_quant.py``'s).

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

# The ``QUANT`` constexpr of the producing kernels: 0 stores the 16-bit row; "int8_zp": int8 with a zero point a row.
KINDS = {"fp8": 1, "int8": 2, "int8_zp": 3}
_QDTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8, "int8_zp": torch.int8}


@dataclass(frozen=True)
class QuantizedRows:
    """Rows quantized by their producer, in place of the 16-bit rows a linear takes."""

    q: torch.Tensor  # [T, K] float8_e4m3fn or int8
    scales: torch.Tensor  # [T, 1] float32
    dtype: torch.dtype  # the 16-bit (or float32) type the rows had, which the product returns
    zeros: torch.Tensor | None = None  # [T, 1] float32 zero points (int8 rows quantized asymmetrically)

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
        if self.q.dtype != torch.int8:
            return "fp8"
        return "int8" if self.zeros is None else "int8_zp"


def empty_rows(kind: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> QuantizedRows:
    """Room for ``rows`` quantized rows of ``cols`` values of ``kind`` ("fp8", "int8" or "int8_zp")."""
    zeros = torch.empty((rows, 1), dtype=torch.float32, device=device) if kind == "int8_zp" else None
    return QuantizedRows(torch.empty((rows, cols), dtype=_QDTYPES[kind], device=device),
                         torch.empty((rows, 1), dtype=torch.float32, device=device), dtype, zeros)


@triton.jit
def params_of(lo, hi, KIND: tl.constexpr, EXACT: tl.constexpr):
    """(scale, zero point) of a row whose smallest and largest values are ``lo`` and ``hi`` (float32, both ranges
    holding 0), as the consumer's quantizer computes them (``EXACT``: compiled NVIDIA code, where int8's quantizer
    multiplies by the reciprocal as torch on CUDA does); the zero point is 0 but for "int8_zp"."""
    if KIND == 3:
        return int8_quant.row_params(lo, hi, EXACT, EXACT)
    else:
        amax = tl.maximum(-lo, hi)  # max |x|: exact
        if KIND == 1:
            return fp8_quant.row_scale(amax), 0.0
        else:
            return int8_quant.row_scale(amax, EXACT, EXACT), 0.0


@triton.jit
def quantized(x, scale, zero, KIND: tl.constexpr, EXACT: tl.constexpr):
    """float32 ``x`` over its row's ``scale`` (plus its ``zero`` point): float8-range values (the cast to float8
    rounds them) or int8."""
    if KIND == 1:
        return fp8_quant.to_fp8_range(x, scale)
    elif KIND == 2:
        return int8_quant.quantize_int8(x, scale, EXACT)
    else:
        return int8_quant.quantize_int8_zero(x, scale, zero, EXACT)


@triton.jit
def quantize_row(o, mask, KIND: tl.constexpr, EXACT: tl.constexpr):
    """(values to store, scale, zero point) of one row held whole in float32 ``o`` (already rounded to its 16-bit
    type); masked entries count as zeros, which every range holds."""
    o0 = tl.where(mask, o, 0.0)
    scale, zero = params_of(tl.minimum(tl.min(o0, axis=0), 0.0), tl.maximum(tl.max(o0, axis=0), 0.0), KIND, EXACT)
    return quantized(o, scale, zero, KIND, EXACT), scale, zero
