"""Matrix products of 4/8-bit weight-only linears (AWQ, GPTQ, compressed-tensors W4A16 / W8A16) with the weight kept
packed on the CPU.

Contract (``layers/quantization/wna16_layout.py`` depends on exactly this):
- ``available()``: whether the compiled kernel runs here; callers keep the torch path when it does not.
- ``supports(bits, group, k)``: whether the kernel reads weights of ``bits`` bits in groups of ``group`` of ``k``
  inputs (4 or 8 bits; ``k`` a multiple of eight words' inputs; ``group`` a whole number of words).
- ``wna16_mm(x, qrows, scales, zeros, bits, group)``: x [M, K] float32, qrows [N, K / pack] int32 (value i of word
  j is input pack * j + i), scales and zeros [N, G] float32 -> [M, N] float32, where
  ``W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g]``, ``g = k // group``.
- ``wna16_decode(qrows, scales, zeros, bits, group)``: the weight [N, K] float32, equal bit for bit to the torch
  path's ``(q - z).float() * s``.

The work is done by ``wna16_gemm.c``, built at first use (``build.py``) for AVX2 + FMA with OpenMP, on
``torch.get_num_threads()`` threads. Up to ``FUSED_MAX_ROWS`` rows of x (decode) the words are decoded while they
are multiplied, each read once for all rows; more rows (a prompt) decode the weight once for one ``torch.mm``,
whose register-blocked product is faster there.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pagedllm.kernels.cpu.build import load_vector_kernel

SOURCE = Path(__file__).with_name("wna16_gemm.c")
# -ffp-contract=off: a decoded weight is rounded once, after its subtraction, as the torch path rounds it.
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
FUSED_MAX_ROWS = 16
SUPPORTED_BITS = (4, 8)

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.wna16_mm_f32.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _int, _i64, _ptr, _int]
    lib.wna16_mm_f32.restype = _int
    lib.wna16_decode_f32.argtypes = [_ptr, _ptr, _ptr, _i64, _i64, _int, _i64, _i64, _ptr, _int]
    lib.wna16_decode_f32.restype = _int
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_vector_kernel(SOURCE, FLAGS, _declare, "4/8-bit weight-only linears take the torch path")


def available() -> bool:
    """Whether the compiled kernel runs here (built on first call, a few seconds, then cached on disk)."""
    return _library() is not None


def supports(bits: int, group: int, k: int) -> bool:
    pack = 32 // bits if bits in SUPPORTED_BITS else 0
    return pack > 0 and k % (8 * pack) == 0 and group > 0 and group % pack == 0


def _check(qrows: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group: int) -> tuple[int, int, int]:
    """(N, K, G) of the operands, after checking what the kernel relies on."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"wna16_mm: bits {bits} is not one of {SUPPORTED_BITS}")
    if qrows.dtype != torch.int32 or qrows.dim() != 2 or not qrows.is_cpu or not qrows.is_contiguous():
        raise ValueError(f"qrows: {qrows.dtype} {tuple(qrows.shape)} on {qrows.device}: must be a contiguous 2-D "
                         "torch.int32 CPU tensor [N, K / pack]")
    n, k = qrows.shape[0], qrows.shape[1] * (32 // bits)
    if not supports(bits, group, k):
        raise ValueError(f"wna16_mm: K={k} inputs in groups of {group} at {bits} bits: K must be a multiple of "
                         f"{8 * 32 // bits} and the group a multiple of {32 // bits}")
    g = -(-k // group)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.dtype != torch.float32 or tuple(t.shape) != (n, g) or not t.is_cpu or not t.is_contiguous():
            raise ValueError(f"{name}: {t.dtype} {tuple(t.shape)} on {t.device}: must be a contiguous float32 "
                             f"CPU tensor [{n}, {g}]")
    return n, k, g


def wna16_decode(qrows: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                 group: int) -> torch.Tensor:  # [N, K] float32
    n, k, g = _check(qrows, scales, zeros, bits, group)
    out = torch.empty(n, k, dtype=torch.float32)
    _library().wna16_decode_f32(qrows.data_ptr(), scales.data_ptr(), zeros.data_ptr(), g, group, bits, n, k,
                                out.data_ptr(), torch.get_num_threads())
    return out


def wna16_mm(x: torch.Tensor, qrows: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
             group: int) -> torch.Tensor:  # [M, K] float32 -> [M, N] float32
    n, k, g = _check(qrows, scales, zeros, bits, group)
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_cpu or x.shape[1] != k:
        raise ValueError(f"x: {x.dtype} {tuple(x.shape)} on {x.device}: must be a 2-D torch.float32 CPU tensor "
                         f"[M, {k}]")
    m = x.shape[0]
    if m > FUSED_MAX_ROWS:
        return x @ wna16_decode(qrows, scales, zeros, bits, group).t()
    y = torch.empty(m, n, dtype=torch.float32)
    if m == 0 or n == 0:
        return y
    x = x.contiguous()
    if _library().wna16_mm_f32(x.data_ptr(), m, k, qrows.data_ptr(), scales.data_ptr(), zeros.data_ptr(), g, group,
                               bits, n, y.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"wna16_mm: no memory for the {m} x {k} activation copy")
    return y
