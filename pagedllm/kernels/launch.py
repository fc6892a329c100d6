"""Launch options shared by the engine's Triton kernels: programmatic dependent launch (PDL) on Hopper and later.

A decode step is a few hundred short kernels, and at small batches the gaps between them are a visible
share of the step. With PDL a kernel is launched while its predecessor on the stream is still running;
each of our kernels then executes ``gdc_wait`` before it reads anything a kernel of the step may have
written, which blocks until the predecessor has finished and its writes are visible. Results are those
of serialized launches; what overlaps is the launch itself, plus what a kernel does before its wait:
small-grid kernels (norms, activations, rotary, the split reduction) let their successor launch at
once; the GEMV and the skinny GEMM read their first weight tile, the norms their weights, and the q/k
norm + rotary launch its positions and cache slots (written by the host before the step's first
launch, which runs fully serialized) before waiting, and decode attention its request's length and
the first tile's L2 lines (``prefetch_to_l2``). On by default on CUDA devices of compute
capability >= 9.0, where it took 4% off a batch-1 8B decode step; the engine turns it off at start-up
(``set_pdl``) when the user asks (``PAGEDLLM_PDL=0``).

Only launches over at most ``PDL_MAX_TOKENS`` tokens use it: decode steps and short chunks, which are
launch-latency-bound and CUDA-graph-captured. A long prefill is compute-bound, runs eagerly and is close
to host-bound there; with PDL on its launches too, the batch-1 time to first token of a 1000-token 8B
prompt measured 34-38 ms in three of five processes, against 23 ms in four of four without.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def device_is_hopper_or_later(index: int) -> bool:
    """Compute capability >= 9.0: PDL and TMA exist."""
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.cache
def triton_interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``): read on first use, once, as
    triton itself fixes the choice when a kernel is decorated."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# The largest CUDA-graph decode batch of the default max_num_seqs.
PDL_MAX_TOKENS = 256

# Set once by the engine at start-up (``set_pdl``), so that no launch reads the environment.
_pdl_enabled = True


def set_pdl(enabled: bool) -> None:
    """Allows (the default) or forbids programmatic dependent launch for every later launch in this process."""
    global _pdl_enabled
    _pdl_enabled = enabled


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels over ``t`` (tokens first) launch with PDL (and so must wait on their predecessor)."""
    if not (_pdl_enabled and t.is_cuda):
        return False
    if t.dim() and t.shape[0] > PDL_MAX_TOKENS:
        return False
    if triton_interpreted():
        return False  # the interpreter runs programs one by one and knows no grid dependency control
    return device_is_hopper_or_later(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_launch_args(t: torch.Tensor) -> dict:
    """Keyword arguments for a kernel launch: the ``USE_GDC`` constexpr, plus ``launch_pdl`` when on."""
    return {"USE_GDC": True, "launch_pdl": True} if use_pdl(t) else {"USE_GDC": False}


@triton.jit
def wait_for_previous_kernel(USE_GDC: tl.constexpr, SMALL_GRID: tl.constexpr):
    """A kernel's first statement: under PDL, block until the previous kernel's writes are visible; a
    small grid then lets the next kernel launch at once (it waits for this one in the same way)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        if SMALL_GRID:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_to_l2(ptrs, mask):
    """Ask L2 for the 128-byte lines holding ``ptrs`` where ``mask``, without waiting for them: a hint,
    issued before a PDL wait, for data read right after it. Compiled code only (inline PTX)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs.to(tl.int64, bitcast=True), mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


# The longest row one program holds whole in registers (16 warps: 32 values a thread).
WHOLE_ROW_MAX = 16384


def row_tile(n: int) -> tuple[int, bool, int]:
    """(BLOCK, whole row, num_warps) for kernels that reduce a row of ``n`` values and then rewrite it (a
    row's quantizers): a row of up to ``WHOLE_ROW_MAX`` is read once into one tile, with warps enough to
    keep its loads in flight (256 rows of 14336 took 27 us on an H100 as two passes of 4 warps); longer
    rows take two passes of 1024."""
    block = triton.next_power_of_2(max(n, 1))
    if block > WHOLE_ROW_MAX:
        return 1024, False, 4
    return block, True, max(4, min(16, block // 1024))


@functools.lru_cache(maxsize=None)
def max_shared_memory(index: int) -> int:
    """Bytes of shared memory one program may use on CUDA device ``index`` (227 KiB on an H100, 99 KiB on
    consumer GPUs): tiles sized for Hopper take fewer pipeline stages or rows where it is smaller."""
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


# Tiles a split launch may have under one count buffer; wider products sum their splits afterwards.
MAX_SPLIT_TILES = 1 << 16
_SPLIT_COUNTS: dict[str, torch.Tensor] = {}  # device -> [MAX_SPLIT_TILES] int32 zeros, kept for the process's life


def split_counts(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's buffer of per-tile split counts for launches whose last split to finish sums the others
    (the W4A16 GEMV, the int8 tiles): zero between launches, since each launch's last split clears its own
    count. Made once outside CUDA-graph capture (a capture would record its zeroing, not run it) and never
    freed, since captured graphs hold its address; None where it cannot serve. Launches on one stream share it:
    a launch clears its counts before it ends, so the next one finds them zero."""
    key = str(device)
    if key not in _SPLIT_COUNTS:
        if tiles > MAX_SPLIT_TILES or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return None
        _SPLIT_COUNTS[key] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return _SPLIT_COUNTS[key] if tiles <= MAX_SPLIT_TILES else None
