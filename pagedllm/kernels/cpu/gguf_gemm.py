"""Matrix products with GGUF-quantized weights kept packed on the CPU: ``x @ W.T`` where W stays in ggml blocks.

Contract (callers in layers/ depend on exactly this):
- ``KERNEL_TYPES``: ggml type ids the kernel reads packed (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K).
- ``available()``: whether the kernel can run here; callers keep weights dense when it cannot.
- ``gguf_mm(x, qweight, qtype)``: x [M, K] float32, qweight [N, K // block * type_size] uint8 rows of blocks
  -> [M, N] float32.
- ``gguf_mm(x, qweight, qtype, int8_activations=True)``: the same product with each row of x first quantized to
  signed bytes in groups of 32 (llama.cpp's arithmetic, ``gguf_q8_gemm.c``: integer dot products), up to
  ``Q8_MAX_ROWS`` rows of x (decode); more rows, or where that kernel is not built, take the float32 product.
- ``gguf_dequantize(qweight, qtype)``: [N, row_bytes] uint8 -> [N, K] float32 (for row gathers: embeddings).
- ``gguf_dequantize_rows(qweight, qtype, ids)``: ids [T] int64 -> [T, K] float32, only those rows decoded.

The work is done by ``gguf_gemm.c``, built at first use (``build.py``) for AVX2 + FMA + F16C with OpenMP
(plus AVX-512 where torch runs its AVX-512 kernels), on ``torch.get_num_threads()`` threads. Decoded weights equal gguf-py's ``dequantize`` bit for bit; a product
differs from ``x @ gguf_dequantize(W).T`` only by float32 rounding (x is not quantized). Up to
``FUSED_MAX_ROWS`` rows of x (decode), and for weights too large to decode whole, the blocks are decoded
while they are multiplied, each block read once for all rows, each output computed by one thread in a
fixed order (results do not depend on the thread count). More rows of a weight of at most
``DECODED_MAX_ELEMS`` (prefill) decode it whole for one ``torch.mm``.
Without the built library (no compiler, no AVX2/FMA, a failed build) every function still answers, through
gguf-py and torch, slowly; ``available()`` is then False and says why once in the log.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import torch

from pagedllm.kernels.cpu.build import load_vector_kernel


# ggml type id -> (elements per block, bytes per block)
BLOCKS: dict[int, tuple[int, int]] = {2: (32, 18), 6: (32, 22), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
KERNEL_TYPES: frozenset[int] = frozenset(BLOCKS)
TYPE_NAMES = {2: "Q4_0", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}

SOURCE = Path(__file__).with_name("gguf_gemm.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
# Where torch runs AVX-512 kernels, the one- and two-row products of Q4_0 / Q5_0 / Q8_0 use 16-float vectors.
AVX512_FLAGS = ("-mavx512f",)

# Above FUSED_MAX_ROWS rows of x, a weight of at most DECODED_MAX_ELEMS elements (16 MiB as float32: every
# matrix of a small model but its embedding) is decoded whole for one torch.mm, whose register-blocked
# product is faster there; larger weights, and fewer rows, take the fused product (measured on a 2-core
# Zen 3: at 32 rows the two are even, at 64 and 512 rows torch.mm is 1.1-1.7x faster for the 640 x 2048
# shapes; for the 262144 x 640 LM head the fused product stays faster up to 512 rows).
FUSED_MAX_ROWS = 16
DECODED_MAX_ELEMS = 1 << 22

# The integer path serves decode steps; a prompt's rows stay float32 (a register-blocked float product is
# compute-bound there, and a prompt's activations are where outliers are largest).
Q8_MAX_ROWS = 16
Q8_SOURCE = Path(__file__).with_name("gguf_q8_gemm.c")

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Gives the built library's entry points their C signatures (ctypes would pass 32-bit ints)."""
    lib.gguf_mm_f32.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, ctypes.c_int]
    lib.gguf_mm_f32.restype = ctypes.c_int
    lib.gguf_dequant_rows.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, ctypes.c_int]
    lib.gguf_dequant_rows.restype = _i64
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_vector_kernel(SOURCE, FLAGS, declare, "quantized weights take the dense path", AVX512_FLAGS)


def _declare_q8(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.gguf_mm_q8.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, ctypes.c_int]
    lib.gguf_mm_q8.restype = ctypes.c_int
    return lib


def _dot_product_flags() -> tuple[str, ...]:
    """Compiler flags for the CPU's byte dot-product instructions (AVX-512 VNNI, else AVX-VNNI), if it has them."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return ()
    if "avx512_vnni" in flags and "avx512vl" in flags:
        return ("-mavx512vnni", "-mavx512vl")
    return ("-mavxvnni",) if "avx_vnni" in flags else ()


@functools.cache
def _q8_library() -> ctypes.CDLL | None:
    return load_vector_kernel(Q8_SOURCE, FLAGS + _dot_product_flags(), _declare_q8,
                              "int8 activations take the float32 product")


def available() -> bool:
    """Whether the compiled kernels run here (built on first call, a few seconds, then cached on disk)."""
    return _library() is not None


def _check_qtype(qtype: int) -> tuple[int, int]:
    if qtype not in BLOCKS:
        names = ", ".join(f"{t} ({n})" for t, n in sorted(TYPE_NAMES.items()))
        shown = int(qtype) if isinstance(qtype, int) else repr(qtype)
        raise ValueError(f"qtype={shown}: must be a ggml type id the kernel reads, one of {names}")
    return BLOCKS[qtype]


def _check_qweight(qweight: torch.Tensor, qtype: int) -> int:
    """K of the rows of ``qweight``, after checking its dtype, layout and row length."""
    block, size = _check_qtype(qtype)
    if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.uint8 or qweight.dim() != 2:
        what = f"{qweight.dtype} {tuple(qweight.shape)}" if isinstance(qweight, torch.Tensor) else type(qweight).__name__
        raise ValueError(f"qweight: {what}: must be a 2-D torch.uint8 tensor [N, row_bytes]")
    if not qweight.is_cpu or not qweight.is_contiguous():
        raise ValueError(f"qweight: device {qweight.device}, contiguous={qweight.is_contiguous()}: "
                         "must be a contiguous CPU tensor")
    row_bytes = qweight.shape[1]
    if row_bytes % size:
        raise ValueError(f"qweight.shape[1]={row_bytes}: must be a multiple of {TYPE_NAMES[qtype]}'s "
                         f"{size}-byte block")
    return row_bytes // size * block


def gguf_dequantize_rows(qweight: torch.Tensor, qtype: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the quantized weight, decoded: qweight [N, row_bytes] u8, ids [T] int64 -> [T, K] f32."""
    K = _check_qweight(qweight, qtype)
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1 or ids.device.type != "cpu":
        what = f"{ids.dtype} {tuple(ids.shape)} on {ids.device}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"ids: {what}: must be a 1-D torch.int64 CPU tensor")
    return _rows(qweight, qtype, K, ids.contiguous())


def gguf_dequantize(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """The whole quantized weight decoded: [N, row_bytes] u8 -> [N, K] f32, equal to gguf-py's dequantize."""
    return _rows(qweight, qtype, _check_qweight(qweight, qtype), None)


def _rows(qweight: torch.Tensor, qtype: int, K: int, ids: torch.Tensor | None) -> torch.Tensor:  # -> [T, K]
    N = qweight.shape[0]
    T = N if ids is None else ids.shape[0]
    lib = _library()
    if lib is None:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        if ids is not None:
            bad = ids[(ids < 0) | (ids >= N)]
            if bad.numel():
                raise ValueError(f"ids: {int(bad[0])} is out of range: must be in [0, {N})")
            qweight = qweight[ids]
        out = dequantize(qweight.numpy(), GGMLQuantizationType(qtype))
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(T, K)
    out = torch.empty(T, K, dtype=torch.float32)
    bad = lib.gguf_dequant_rows(qtype, qweight.data_ptr(), qweight.shape[1], N, K,
                                None if ids is None else ids.data_ptr(), T, out.data_ptr(), torch.get_num_threads())
    if bad:
        raise ValueError(f"ids: {int(ids[bad - 1])} is out of range: must be in [0, {N})")
    return out


def gguf_mm(x: torch.Tensor, qweight: torch.Tensor, qtype: int, int8_activations: bool = False) -> torch.Tensor:
    """``x @ W.T`` with W given by its ggml blocks: x [M, K] f32, qweight [N, row_bytes] u8 -> [M, N] f32.

    ``int8_activations``: up to ``Q8_MAX_ROWS`` rows of x are quantized to bytes in groups of 32 first."""
    blocks = BLOCKS.get(qtype)
    # One expression for the common case: a decode step makes over a hundred of these calls.
    valid = (blocks is not None and isinstance(x, torch.Tensor) and isinstance(qweight, torch.Tensor)
             and x.dtype == torch.float32 and qweight.dtype == torch.uint8 and x.dim() == 2 and qweight.dim() == 2
             and x.is_cpu and qweight.is_cpu and qweight.is_contiguous() and x.shape[1] % blocks[0] == 0
             and x.shape[1] // blocks[0] * blocks[1] == qweight.shape[1])
    if not valid:
        _refuse_mm(x, qweight, qtype)
    lib = _library()
    (M, K), N = x.shape, qweight.shape[0]
    if lib is None:
        return x @ gguf_dequantize(qweight, qtype).t()
    if M == 0 or N == 0:
        return torch.zeros(M, N, dtype=torch.float32)
    x = x.contiguous()
    if M > FUSED_MAX_ROWS and N * K <= DECODED_MAX_ELEMS:
        return x @ _rows(qweight, qtype, K, None).t()
    y = torch.empty(M, N, dtype=torch.float32)
    if int8_activations and M <= Q8_MAX_ROWS and (q8 := _q8_library()) is not None:
        if q8.gguf_mm_q8(qtype, x.data_ptr(), M, K, qweight.data_ptr(), qweight.shape[1], N, y.data_ptr(),
                         torch.get_num_threads()):
            raise MemoryError(f"gguf_mm: no memory for the {M} x {K} quantized activations")
        return y
    status = lib.gguf_mm_f32(qtype, x.data_ptr(), M, K, qweight.data_ptr(), qweight.shape[1], N, y.data_ptr(),
                             torch.get_num_threads())
    if status:
        raise MemoryError(f"gguf_mm: no memory for the {M} x {K} activation copy")
    return y


def _refuse_mm(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> None:
    """Raises the ValueError that names what is wrong with gguf_mm's arguments."""
    K = _check_qweight(qweight, qtype)
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2 or not x.is_cpu:
        what = f"{x.dtype} {tuple(x.shape)} on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x: {what}: must be a 2-D torch.float32 CPU tensor [M, K]")
    block, size = BLOCKS[qtype]
    if x.shape[1] % block:
        raise ValueError(f"x.shape[1]={x.shape[1]}: must be a multiple of {TYPE_NAMES[qtype]}'s {block}-element block")
    raise ValueError(f"qweight.shape[1]={qweight.shape[1]}: must be {x.shape[1] // block * size} bytes, "
                     f"the {TYPE_NAMES[qtype]} blocks of a row of K={x.shape[1]} (x.shape[1]), not K={K}")
