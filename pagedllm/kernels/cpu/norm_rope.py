"""RMSNorm (residual add fused, plain or Gemma's ``1 + weight``) and in-place rotary embedding on float32 CPU rows.

Contract (``layers/norm.py`` and ``layers/rotary.py`` depend on exactly this):
- ``available()``: whether the compiled kernels run here; the layers take their torch path when not.
- ``usable_norm(x, weight, residual)``: whether ``rms_norm`` takes these tensors (float32 CPU, channels
  contiguous, x 2-D or a [T, heads, H] view with a row stride, weight [H]); callers use torch otherwise.
- ``rms_norm(x, weight, eps, residual, gemma)``: x [..., H] -> out [..., H] contiguous, and with a
  residual [..., H] also ``x + residual`` as a new contiguous tensor; neither input is written.
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

from pagedllm.kernels.cpu.build import BuildError, build

logger = logging.getLogger("pagedllm")

SOURCE = Path(__file__).with_name("norm_rope.c")
# -ffp-contract=off: no fused multiply-adds, so rotary rounds every product as torch does (bit-identical).
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")

_i64, _ptr, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


@functools.cache
def _library() -> ctypes.CDLL | None:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        reason = f"the CPU's vector capability is {capability}, the kernels need AVX2"
    else:
        try:
            lib = build(SOURCE, FLAGS)
        except BuildError as e:
            reason = str(e)
        else:
            lib.rms_norm_f32.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _f32, _int, _int, _int]
            lib.rms_norm_f32.restype = None
            lib.rotary_f32.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _int, _int]
            lib.rotary_f32.restype = None
            return lib
    logger.warning("CPU norm/rotary kernels unavailable (%s): RMSNorm and rotary take the torch path", reason)
    return None


@functools.cache
def _torch_lanes() -> int:
    """Floats in a vector of torch's CPU kernels here, whose summation order the norm's kernel follows."""
    return 16 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 8


def available() -> bool:
    """Whether the compiled kernels run here (built on first call, a second or so, then cached on disk)."""
    return _library() is not None


def _rows_layout(x: torch.Tensor) -> tuple[int, int, int] | None:
    """(token stride, head stride, heads) of x [T, H] or [T, heads, H] with contiguous channels, else None."""
    if x.stride(-1) != 1:
        return None
    if x.dim() == 2:
        return x.stride(0), 0, 1
    if x.dim() == 3:
        return x.stride(0), x.stride(1), x.shape[1]
    return None


def usable_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether ``rms_norm`` takes these tensors; the caller's torch path serves every other case."""
    # One expression: a decode step makes ~100 of these checks.
    return (x.dtype == torch.float32 and x.device.type == "cpu" and weight.dtype == torch.float32
            and weight.device.type == "cpu" and weight.dim() == 1 and weight.is_contiguous()
            and x.dim() in (2, 3) and x.shape[-1] == weight.shape[0] and x.stride(-1) == 1
            and not x.requires_grad and not weight.requires_grad
            and (residual is None or (residual.dtype == torch.float32 and residual.shape == x.shape
                                      and residual.device.type == "cpu" and residual.is_contiguous()))
            and _library() is not None)


def rms_norm(
    x: torch.Tensor,  # [T, H] or [T, heads, H] float32, channels contiguous
    weight: torch.Tensor,  # [H] float32
    eps: float,
    residual: torch.Tensor | None = None,  # x's shape, contiguous
    gemma: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # out; with a residual (out, x + residual)
    """``RMSNorm.forward`` (``GemmaRMSNorm``'s with ``gemma``) for tensors ``usable_norm`` accepts."""
    layout = _rows_layout(x) if x.dim() in (2, 3) else None
    if layout is None or not usable_norm(x, weight, residual):
        raise ValueError(f"x: {x.dtype} {tuple(x.shape)} stride {x.stride()}, weight: {weight.dtype} "
                         f"{tuple(weight.shape)}: must be float32 CPU [T, H] or [T, heads, H] with contiguous "
                         "channels and weight [H] (residual, if given, contiguous and of x's shape)")
    tok, head, heads = layout
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    out = torch.empty(x.shape, dtype=torch.float32)
    new_residual = None if residual is None else torch.empty(x.shape, dtype=torch.float32)
    if rows and n:
        _library().rms_norm_f32(x.data_ptr(), tok, head, heads,
                                None if residual is None else residual.data_ptr(),
                                None if residual is None else new_residual.data_ptr(),
                                out.data_ptr(), rows, n, weight.data_ptr(), eps, int(gemma), _torch_lanes(),
                                torch.get_num_threads())
    return out if residual is None else (out, new_residual)


def usable_rotary(x: torch.Tensor, head_size: int) -> bool:
    """Whether ``rotary_`` rotates x ([T, heads * D] or [T, heads, D]) in place."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1 and not x.requires_grad
            and (x.dim() == 3 and x.shape[2] == head_size or x.dim() == 2 and x.shape[1] % head_size == 0)
            and _library() is not None)


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
    if x.dim() == 3:
        heads, tok, head = x.shape[1], x.stride(0), x.stride(1)
    else:
        heads, tok, head = x.shape[1] // head_size, x.stride(0), head_size
    if tokens and heads and half:
        _library().rotary_f32(x.data_ptr(), tokens, heads, tok, head, cos.data_ptr(), sin.data_ptr(), half,
                              int(neox), torch.get_num_threads())
    return x
