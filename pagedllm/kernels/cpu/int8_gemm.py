"""The exact int32 product of int8 rows and an int8 weight on the CPU, for W8A8 linears.

Contract (``layers/quantization/int8.py`` depends on exactly this):
- ``available()``: whether the compiled kernel runs here; callers keep ``torch._int_mm`` when it does not.
- ``int8_mm(xq, wq)``: xq [M, K] int8, wq [N, K] int8, both contiguous CPU tensors -> [M, N] int32, equal to
  ``torch._int_mm(xq, wq.t())`` bit for bit (every sum is exact).

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
FLAGS = ("-O3", "-mavx2", "-fopenmp", "-shared", "-fPIC")

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.int8_mm_i32.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _int]
    lib.int8_mm_i32.restype = _int
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
