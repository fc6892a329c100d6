"""Paged decode attention (one query token per request) over a float32 CPU KV cache, in one C call per layer.

Contract (``attention/backends/cpu.py`` depends on exactly this):
- ``available()``: whether the compiled kernel runs here; the backend keeps its torch path when not.
- ``decode_attention(query, k_flat, v_flat, slots, counts, scale, soft_cap)``: query [B, Hq, D] float32
  contiguous; k_flat / v_flat [num_slots, Hkv, D] float32 contiguous (the cache, read in place); slots
  [B, S] int64 cache slots, of which request b sees the first counts[b] (1 <= counts[b] <= S); returns
  [B, Hq, D] float32: softmax(scale * q k^T, soft-capped when ``soft_cap``) v per query head, a query
  head h reading KV head h // (Hq / Hkv). Equal to the torch path up to float32 rounding.
- ``write_kv_if_usable(key, value, k_flat, v_flat, slot_mapping)``: copies this step's key / value [T, Hkv, D]
  (float32, rows of the same strides, channels contiguous) into the cache rows of slot_mapping [T] int64
  (negative: padding, skipped) and returns True; returns False, writing nothing, for tensors it does not take.

The work is done by ``decode_attention.c``, built at first use by ``build.py``; requests and KV heads are
spread over ``torch.get_num_threads()`` threads.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pagedllm.kernels.cpu.build import load_vector_kernel


SOURCE = Path(__file__).with_name("decode_attention.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.decode_attention_f32.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _f32,
                                         _ptr, ctypes.c_int]
    lib.decode_attention_f32.restype = _i64
    lib.write_kv_f32.argtypes = [_ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr]
    lib.write_kv_f32.restype = _i64
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_vector_kernel(SOURCE, FLAGS, _declare, "decode attention takes the torch path")


def available() -> bool:
    """Whether the compiled kernel runs here (built on first call, a second or so, then cached on disk)."""
    return _library() is not None


def decode_attention(
    query: torch.Tensor,  # [B, Hq, D] float32, contiguous
    k_flat: torch.Tensor,  # [num_slots, Hkv, D] float32, contiguous
    v_flat: torch.Tensor,  # [num_slots, Hkv, D] float32, contiguous
    slots: torch.Tensor,  # [B, S] int64, contiguous
    counts: torch.Tensor,  # [B] int64, contiguous, each in 1..S
    scale: float,
    soft_cap: float | None = None,
) -> torch.Tensor:  # [B, Hq, D] float32
    b, hq, d = query.shape
    hkv = k_flat.shape[1]
    tensors = (query, k_flat, v_flat)
    if (any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in tensors)
            or k_flat.shape != v_flat.shape or k_flat.shape[2] != d or hq % hkv
            or slots.dtype != torch.int64 or counts.dtype != torch.int64 or slots.dim() != 2
            or slots.shape[0] != b or counts.shape != (b,) or not slots.is_contiguous() or not counts.is_contiguous()):
        raise ValueError(f"decode_attention: query {query.dtype} {tuple(query.shape)}, cache {k_flat.dtype} "
                         f"{tuple(k_flat.shape)}, slots {slots.dtype} {tuple(slots.shape)}, counts {counts.dtype} "
                         f"{tuple(counts.shape)}: must be contiguous float32 CPU [B, Hq, D] and [slots, Hkv, D] "
                         "(Hq a multiple of Hkv), int64 [B, S] and [B]")
    out = torch.empty_like(query)
    if b == 0:
        return out
    status = _library().decode_attention_f32(
        query.data_ptr(), k_flat.data_ptr(), v_flat.data_ptr(), slots.data_ptr(), counts.data_ptr(), b,
        slots.shape[1], hq, hkv, d, k_flat.shape[0], scale, soft_cap or 0.0, out.data_ptr(), torch.get_num_threads())
    if status == -1:
        raise MemoryError("decode_attention: cannot allocate the scores")
    if status < -1:
        r = -2 - status
        raise ValueError(f"decode_attention: request {r} has count {int(counts[r])} or a visible slot outside the "
                         f"cache's {k_flat.shape[0]} slots (counts must be in 1..{slots.shape[1]})")
    return out


def write_kv_if_usable(
    key: torch.Tensor,  # [T, Hkv, D] float32, channels contiguous
    value: torch.Tensor,  # [T, Hkv, D], key's strides
    k_flat: torch.Tensor,  # [num_slots, Hkv, D] float32, contiguous
    v_flat: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, contiguous
) -> bool:
    """One C call in place of the torch path's masked ``index_copy_`` pair (a decode step writes 1 row a layer)."""
    if not (key.dtype == value.dtype == k_flat.dtype == v_flat.dtype == torch.float32 and key.dim() == 3
            and key.shape == value.shape and key.stride() == value.stride() and key.stride(2) == 1
            and key.stride(1) == key.shape[2] and k_flat.is_contiguous() and v_flat.is_contiguous()
            and k_flat.shape[1:] == key.shape[1:] and v_flat.shape == k_flat.shape
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
            and slot_mapping.shape == (key.shape[0],) and not key.is_cuda and _library() is not None):
        return False
    t, hkv, d = key.shape
    bad = _library().write_kv_f32(key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1), t, hkv, d,
                                  slot_mapping.data_ptr(), k_flat.shape[0], k_flat.data_ptr(), v_flat.data_ptr())
    if bad:
        raise ValueError(f"slot_mapping[{bad - 1}] = {int(slot_mapping[bad - 1])} is outside the cache's "
                         f"{k_flat.shape[0]} slots")
    return True
