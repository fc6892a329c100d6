"""The exact int32 product of int8 rows and an int8 weight on the CPU, for W8A8 linears.

Contract (``layers/quantization/int8.py`` depends on exactly this):
- ``available()``: whether the compiled kernel runs here; callers keep ``torch._int_mm`` when it does not.
- ``int8_mm(xq, wq)``: xq [M, K] int8, wq [N, K] int8, both contiguous CPU tensors -> [M, N] int32, equal to
  ``torch._int_mm(xq, wq.t())`` bit for bit (every sum is exact).
- ``quantize_rows(x)``: x [M, K] float32 -> (q [M, K] int8, scales [M, 1] float32), ``int8_quant.quantize_int8_rows``'
  symmetric arithmetic bit for bit; ``scale_rows(acc, xs, ws)``: acc [M, N] int32 -> ``acc.float() * xs * ws.view(1, -1)``
  [M, N] float32, rounded as torch rounds it. Together with ``int8_mm``, a W8A8 product in three calls where
  torch ops take about a dozen.

The work is done by ``int8_gemm.c``, built at first use (``build.py``) for AVX2 with OpenMP, on
``torch.get_num_threads()`` threads. torch's CPU int8 product took 10-37x its time at 1-64 rows of Gemma 3 270M's
shapes on 2 cores (and ~3x float32's product at one row), so it takes every row count.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pagedllm.kernels.cpu.build import load_vector_kernel

SOURCE = Path(__file__).with_name("int8_gemm.c")
# -ffp-contract=off: the epilogue rounds after each product, as torch does.
FLAGS = ("-O3", "-mavx2", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.int8_mm_i32.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _int]
    lib.int8_mm_i32.restype = _int
    lib.quantize_rows_sym.argtypes = [_ptr, _i64, _i64, _ptr, _ptr]
    lib.quantize_rows_sym.restype = None
    lib.scale_rows.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr]
    lib.scale_rows.restype = None
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_vector_kernel(SOURCE, FLAGS, _declare, "W8A8 products take torch's int8 product")


def available() -> bool:
    """Whether the compiled kernel runs here (built on first call, a few seconds, then cached on disk)."""
    return _library() is not None


def int8_mm(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:  # [M, K] int8 x [N, K] int8 -> [M, N] int32
    for name, t in (("xq", xq), ("wq", wq)):
        if t.dtype != torch.int8 or t.dim() != 2 or not t.is_cpu or not t.is_contiguous():
            raise ValueError(f"{name}: {t.dtype} {tuple(t.shape)} on {t.device}: must be a contiguous 2-D "
                             "torch.int8 CPU tensor")
    (m, k), n = xq.shape, wq.shape[0]
    if wq.shape[1] != k:
        raise ValueError(f"wq: {wq.shape[1]} inputs a row for xq's {k}")
    y = torch.empty(m, n, dtype=torch.int32)
    if m and n and _library().int8_mm_i32(xq.data_ptr(), m, k, wq.data_ptr(), n, y.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"int8_mm: no memory for the {m} x {k} widened activations")
    return y


def _check_float(name: str, t: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() or (shape is not None and tuple(t.shape) != shape):
        want = f" {list(shape)}" if shape is not None else ""
        raise ValueError(f"{name}: {t.dtype} {tuple(t.shape)} on {t.device}: must be a contiguous torch.float32 CPU "
                         f"tensor{want}")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [M, K] -> [M, K] int8, [M, 1] float32
    if x.dim() != 2:
        raise ValueError(f"x: {tuple(x.shape)}: must be 2-D [M, K]")
    _check_float("x", x)
    q = torch.empty(x.shape, dtype=torch.int8)
    scales = torch.empty(x.shape[0], 1, dtype=torch.float32)
    _library().quantize_rows_sym(x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), scales.data_ptr())
    return q, scales


def scale_rows(acc: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:  # [M, N] int32 -> float32
    if acc.dtype != torch.int32 or acc.dim() != 2 or not acc.is_cpu or not acc.is_contiguous():
        raise ValueError(f"acc: {acc.dtype} {tuple(acc.shape)}: must be a contiguous 2-D torch.int32 CPU tensor")
    m, n = acc.shape
    _check_float("xs", xs, (m, 1))
    _check_float("ws", ws.reshape(-1), (n,))
    out = torch.empty(m, n, dtype=torch.float32)
    _library().scale_rows(acc.data_ptr(), m, n, xs.data_ptr(), ws.reshape(-1).data_ptr(), out.data_ptr())
    return out
