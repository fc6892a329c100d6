"""Packed CPU weights moved into one arena of transparent huge pages (Linux ``madvise(MADV_HUGEPAGE)``).

A decode step streams every weight once. In 4 KiB pages the default model's 246 MB of packed weights are
~60k pages: the products miss the TLB all along, and the page walks evict the translations and page-walk
caches that the rest of the step (the interpreter's own code and data) needs next. In 2 MiB pages they are
~120. Measured on a 2-core Zen 4: the LM head product at one row 5.86 -> 4.94 ms, and the first Python
call after it 351 -> 215 us. torch's allocator does this only when ``THP_MEM_ALLOC_ENABLE`` is set before it
is imported, and per tensor of at least 2 MiB (most of a small model's matrices are smaller), hence one
arena here. Where the system has no huge pages to give, the arena is ordinary memory and nothing changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch
from torch import nn

logger = logging.getLogger("pagedllm")

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux
_ALIGN = 64  # each tensor starts on a cache line


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_page_buffer(nbytes: int) -> torch.Tensor:  # [nbytes] uint8, not yet touched
    """A uint8 buffer whose whole 2 MiB pages are advised for huge pages (before any is touched, so that the
    first write faults them in as huge pages)."""
    buf = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -buf.data_ptr() % HUGE_PAGE
    advise = _madvise()
    length = nbytes // HUGE_PAGE * HUGE_PAGE
    if advise is not None and length and advise(buf.data_ptr() + offset, length, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed (errno %d): weights stay in small pages", ctypes.get_errno())
    return buf[offset : offset + nbytes]


def move_to_huge_pages(model: nn.Module, names: tuple[str, ...]) -> int:
    """Copies every CPU uint8 buffer of ``model`` whose name is in ``names`` (or starts with one ending in
    ``_``) into one huge-page arena and points the modules at it; a tensor shared by several modules
    (a tied LM head) is copied once. Returns the bytes moved."""
    found: list[tuple[nn.Module, str, torch.Tensor]] = []
    for module in model.modules():
        for name, t in module._buffers.items():
            if (t is not None and t.dtype == torch.uint8 and t.device.type == "cpu" and t.is_contiguous()
                    and any(name == n or (n.endswith("_") and name.startswith(n)) for n in names)):
                found.append((module, name, t))
    offsets: dict[int, int] = {}
    total = 0
    for _, _, t in found:
        if id(t) not in offsets:
            offsets[id(t)] = total
            total += -(-t.numel() // _ALIGN) * _ALIGN
    if total == 0:
        return 0
    arena = huge_page_buffer(total)
    views: dict[int, torch.Tensor] = {}
    # Each original is let go once copied: the peak stays near the weights' size, not twice it (a packed mixture
    # of experts can be most of the machine's memory).
    found.reverse()
    while found:
        module, name, t = found.pop()
        view = views.get(id(t))
        if view is None:
            start = offsets[id(t)]
            view = views[id(t)] = arena[start : start + t.numel()].view(t.shape).copy_(t)
        module._buffers[name] = view
        del t
    return total
