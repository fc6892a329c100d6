"""A started engine's Python objects, frozen out of the garbage collector's full collections.

Once torch, transformers and the model are loaded, a process holds ~500k objects the collector tracks.
A full (oldest-generation) collection walks all of them: ~0.22 s on the H200 machine's host, during
which no step is scheduled and the GPU idles; one landed in about every third pass of workload 1
(Qwen3-0.6B, 5.4 s), making that pass 4-5% slower. After start-up those objects live as long as the
engine, so they are moved to the collector's permanent generation (``gc.freeze``); full collections
then take ~6-11 ms. ``shutdown`` gives them back, so that an engine dropped in a process that goes on
(tests, notebooks) can still have its reference cycles collected. ``PAGEDLLM_GC_FREEZE=0`` turns it off.
"""
from __future__ import annotations

import gc

from pagedllm import envs


def freeze_start_up_heap() -> None:
    """Collects what start-up left as garbage, then freezes every object still alive."""
    if not envs.PAGEDLLM_GC_FREEZE:
        return
    gc.collect()
    gc.freeze()


def unfreeze_heap() -> None:
    """Hands frozen objects back to the collector (an engine shutting down)."""
    gc.unfreeze()
