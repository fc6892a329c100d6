"""RMSNorm (residual add fused, plain or Gemma's ``1 + weight``) and in-place rotary embedding on float32 CPU rows.

Contract (``layers/norm.py`` and ``layers/rotary.py`` depend on exactly this):
- ``available()``: whether the compiled kernels run here; the layers take their torch path when not.
- ``usable_norm(x, weight, residual)``: whether ``rms_norm`` takes these tensors (float32 CPU, channels
  contiguous, x 2-D or a [T, heads, H] view with a row stride, weight [H]); callers use torch otherwise.
- ``rms_norm(x, weight, eps, residual, gemma)``: x [..., H] -> out [..., H] contiguous, and with a
  residual [..., H] also ``x + residual`` as a new contiguous tensor; neither input is written.
  ``rms_norm_if_usable``: the same, or None for tensors ``usable_norm`` refuses (one check per call).
- ``usable_rotary(x, head_size)`` / ``rotary_(x, cos, sin, head_size, neox)``: x [T, heads * D] or
  [T, heads, D] float32 (channels contiguous), cos / sin [T, R / 2] float32; the first R channels of
  every head rotated in place, bit-identical to ``RotaryEmbedding``'s torch arithmetic.

The work is done by ``norm_rope.c``, built at first use by ``build.py``; long prefills spread their rows
over ``torch.get_num_threads()`` threads, a decode step's few rows stay on the calling thread.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagedllm.kernels.cpu.build import load_vector_kernel

logger = logging.getLogger("pagedllm")

SOURCE = Path(__file__).with_name("norm_rope.c")
# -ffp-contract=off: no fused multiply-adds, so rotary rounds every product as torch does (bit-identical).
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")

_i64, _ptr, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.rms_norm_f32.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _f32, _int, _int, _int]
    lib.rms_norm_f32.restype = None
    lib.rotary_f32.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _int, _int]
    lib.rotary_f32.restype = None
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_vector_kernel(SOURCE, FLAGS, _declare, "RMSNorm and rotary take the torch path")


@functools.cache
def _torch_lanes() -> int:
    """Floats per vector in the order torch's CPU sum adds a row here, which the norm's kernel follows.

    Measured, not read from ``get_cpu_capability()``: a build may report AVX512 and still reduce float
    rows with 8-float vectors. 0 when neither width reproduces torch's sum (the layers then keep torch).
    """
    lib = _library()
    if lib is None:
        return 0
    x = torch.randn(2, 4097, generator=torch.Generator().manual_seed(0)) * 3
    w = torch.randn(4097, generator=torch.Generator().manual_seed(1))
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    for lanes in (8, 16):
        out = torch.empty_like(x)
        lib.rms_norm_f32(x.data_ptr(), x.stride(0), 0, 1, None, None, out.data_ptr(), 2, 4097, w.data_ptr(),
                         1e-6, 0, lanes, 1)
        if torch.equal(out, want):
            return lanes
    logger.warning("CPU norm kernel does not reproduce torch's row sum here: RMSNorm takes the torch path")
    return 0


def available() -> bool:
    """Whether the compiled kernels run here (built on first call, a second or so, then cached on disk)."""
    return _library() is not None


def usable_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether ``rms_norm`` takes these tensors; the caller's torch path serves every other case."""
    # One expression: a decode step makes ~100 of these checks.
    return (x.dtype == torch.float32 and x.is_cpu and weight.dtype == torch.float32 and weight.is_cpu
            and weight.dim() == 1 and weight.is_contiguous() and 2 <= x.dim() <= 3
            and x.shape[-1] == weight.shape[0] and x.stride(-1) == 1
            and not x.requires_grad and not weight.requires_grad
            and (residual is None or (residual.dtype == torch.float32 and residual.shape == x.shape
                                      and residual.is_cpu and residual.is_contiguous()))
            and _torch_lanes() != 0)


def rms_norm(
    x: torch.Tensor,  # [T, H] or [T, heads, H] float32, channels contiguous
    weight: torch.Tensor,  # [H] float32
    eps: float,
    residual: torch.Tensor | None = None,  # x's shape, contiguous
    gemma: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # out; with a residual (out, x + residual)
    """``RMSNorm.forward`` (``GemmaRMSNorm``'s with ``gemma``) for tensors ``usable_norm`` accepts."""
    if not usable_norm(x, weight, residual):
        raise ValueError(f"x: {x.dtype} {tuple(x.shape)} stride {x.stride()}, weight: {weight.dtype} "
                         f"{tuple(weight.shape)}: must be float32 CPU [T, H] or [T, heads, H] with contiguous "
                         "channels and weight [H] (residual, if given, contiguous and of x's shape)")
    return _rms_norm(x, weight, eps, residual, gemma)


def rms_norm_if_usable(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, gemma: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:  # as rms_norm; None where usable_norm is False
    """``rms_norm``, or None (nothing computed) for tensors it does not take: the layers' one check per call."""
    return _rms_norm(x, weight, eps, residual, gemma) if usable_norm(x, weight, residual) else None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
              gemma: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if x.dim() == 2:
        tok, head, heads = x.stride(0), 0, 1
    else:
        tok, head, heads = x.stride(0), x.stride(1), x.shape[1]
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    # empty_like of a contiguous x is ~3x cheaper than empty(shape, dtype=...); a strided x gets a dense buffer.
    out = torch.empty_like(x) if x.is_contiguous() else torch.empty(x.shape, dtype=torch.float32)
    new_residual = None if residual is None else torch.empty_like(residual)
    if rows and n:
        _library().rms_norm_f32(x.data_ptr(), tok, head, heads,
                                None if residual is None else residual.data_ptr(),
                                None if residual is None else new_residual.data_ptr(),
                                out.data_ptr(), rows, n, weight.data_ptr(), eps, gemma, _torch_lanes(),
                                torch.get_num_threads())
    return out if residual is None else (out, new_residual)


def usable_rotary(x: torch.Tensor, head_size: int) -> bool:
    """Whether ``rotary_`` rotates x ([T, heads * D] or [T, heads, D]) in place."""
    return (x.dtype == torch.float32 and x.is_cpu and x.stride(-1) == 1 and not x.requires_grad
            and (x.dim() == 3 and x.shape[2] == head_size or x.dim() == 2 and x.shape[1] % head_size == 0)
            and _torch_lanes() != 0)


def rotary_(
    x: torch.Tensor,  # [T, heads * D] or [T, heads, D] float32, channels contiguous; rotated in place
    cos: torch.Tensor,  # [T, R / 2] float32
    sin: torch.Tensor,  # [T, R / 2] float32
    head_size: int,
    neox: bool,
) -> torch.Tensor:  # x
    """Rotates the first R = 2 * cos.shape[-1] channels of every head of x by its token's angles, in place."""
    if not usable_rotary(x, head_size):
        raise ValueError(f"x: {x.dtype} {tuple(x.shape)} stride {x.stride()}: must be float32 CPU [T, heads * "
                         f"{head_size}] or [T, heads, {head_size}] with contiguous channels")
    tokens = x.shape[0]
    half = cos.shape[-1]
    for name, t in (("cos", cos), ("sin", sin)):
        if (t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
                or t.numel() != tokens * half):
            raise ValueError(f"{name}: {t.dtype} {tuple(t.shape)}: must be contiguous float32 CPU with "
                             f"{tokens} x {half} elements (x's tokens x cos.shape[-1])")
    if 2 * half > head_size:
        raise ValueError(f"cos.shape[-1]={half}: rotates {2 * half} channels, more than head_size={head_size}")
    return _rotate(x, cos, sin, head_size, neox)


def rotary_pair_if_usable(
    query: torch.Tensor,  # [T, Hq * D] or [T, Hq, D]; rotated in place when usable
    key: torch.Tensor,  # [T, Hkv * D] or [T, Hkv, D]; likewise
    cos: torch.Tensor,  # [T, R / 2] float32, contiguous (any shape of that many elements)
    sin: torch.Tensor,  # likewise
    head_size: int,
    neox: bool,
) -> bool:
    """``rotary_`` of query and key where both are usable (one check per call, as a decode step wants),
    returning whether it rotated them; False leaves them untouched."""
    half = cos.shape[-1]
    tokens = query.shape[0]
    if not (usable_rotary(query, head_size) and usable_rotary(key, head_size) and key.shape[0] == tokens
            and 2 * half <= head_size and cos.dtype == torch.float32 and sin.dtype == torch.float32 and cos.is_cpu
            and cos.is_contiguous() and sin.is_contiguous() and cos.numel() == sin.numel() == tokens * half):
        return False
    _rotate(query, cos, sin, head_size, neox)
    _rotate(key, cos, sin, head_size, neox)
    return True


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, neox: bool) -> torch.Tensor:
    if x.dim() == 3:
        heads, tok, head = x.shape[1], x.stride(0), x.stride(1)
    else:
        heads, tok, head = x.shape[1] // head_size, x.stride(0), head_size
    tokens, half = x.shape[0], cos.shape[-1]
    if tokens and heads and half:
        _library().rotary_f32(x.data_ptr(), tokens, heads, tok, head, cos.data_ptr(), sin.data_ptr(), half,
                              neox, torch.get_num_threads())
    return x
