"""A started engine's Python objects, frozen out of the garbage collector's full collections.

Once torch, transformers and the model are loaded, a process holds ~500k objects the collector tracks.
A full (oldest-generation) collection walks all of them: ~0.22 s on the H200 machine's host, during
which no step is scheduled and the GPU idles; one landed in about every third pass of workload 1
(Qwen3-0.6B, 5.4 s), making that pass 4-5% slower. After start-up those objects live as long as the
engine, so they are moved to the collector's permanent generation (``gc.freeze``); full collections
then take ~6-11 ms. ``shutdown`` gives them back, so that an engine dropped in a process that goes on
(tests, notebooks) can still have its reference cycles collected. ``PAGEDLLM_GC_FREEZE=0`` turns it off.

Start-up also leaves the C heap full of freed memory that glibc keeps for reuse: parsing a 262k-token
tokenizer.json peaks ~250 MiB above what the tokenizer keeps, and reading a GGUF file's metadata does the
same in the engine core. ``trim_heap`` hands those pages back to the system, so that the resident memory of
a served model is what it uses.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys

from pagedllm import envs


def freeze_start_up_heap() -> None:
    """Collects what start-up left as garbage, then freezes every object still alive."""
    if envs.PAGEDLLM_GC_FREEZE:
        gc.collect()
        gc.freeze()
    trim_heap()


def trim_heap() -> None:
    """Returns the C heap's free pages to the system (glibc's ``malloc_trim``; nothing elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl and other C libraries have no malloc_trim
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def unfreeze_heap() -> None:
    """Hands frozen objects back to the collector (an engine shutting down)."""
    gc.unfreeze()
