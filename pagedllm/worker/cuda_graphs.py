"""CUDA graphs of forward passes at padded sizes: capture once, replay every step.

A forward pass is hundreds of kernels, and launched one by one from Python the CPU often sets the
pace: an eager 8B forward takes ~46 ms of host time on a slow host, against 21 ms of device work for a
1000-token prompt. Replaying a captured graph launches them all at once. Two families exist:
pure-decode batches, keyed by the padded request count, and mixed batches (prompt chunks, with or
without decode tokens), keyed by the padded token count with a fixed request count. A graph fixes its
inputs' addresses and every launch parameter, so the runner (a) feeds it through the fixed views of
StepBuffers and (b) builds the captured attention metadata from upper bounds (max_model_len, the
padded token count) rather than from the step's own lengths: the kernels then read the actual lengths
from device memory.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger("pagedllm")

# Larger decode batches gain little from graphs (the GPU work dwarfs the launches) and cost capture time.
MAX_CAPTURE_SIZE = 512


# Mixed-batch graphs: powers of two up to this, then four sizes per octave (at most 25% padding, and
# less in practice: cuBLAS tiles are 128-256 rows, so padding inside a tile costs nothing).
_TOKEN_FINE_FROM = 256
_MIN_TOKEN_SIZE = 16
# Larger steps run eagerly: their device time (~170 ms for 8k tokens of an 8B model, ~10 ms for a 0.6B
# one) dwarfs the host's launches, and each larger graph would add capture time and pool memory.
MAX_TOKEN_CAPTURE_SIZE = 8192


def warm_up_sizes(sizes: list[int]) -> set[int]:
    """The capture sizes that get an eager warm-up: the largest of each Triton specialisation class.

    Triton specialises an integer argument on == 1 and on divisibility by 16 and compiles a variant per
    class; the warm-up compiles it outside the capture, where host synchronisation is allowed. The
    other sizes of a class reuse that variant, so they skip the eager pass (~30 of 34 at the defaults).
    """
    first: dict[tuple[bool, bool], int] = {}
    for size in sorted(sizes, reverse=True):
        first.setdefault((size == 1, size % 16 == 0), size)
    return set(first.values())


def token_capture_sizes(max_num_batched_tokens: int, max_size: int = MAX_TOKEN_CAPTURE_SIZE) -> list[int]:
    """Token counts of the mixed-batch graphs: 16, 32, ..., 256, then 320, 384, 448, 512, 640, ...,
    up to the cap min(max_num_batched_tokens, max_size), which always has its own graph."""
    max_tokens = min(max_num_batched_tokens, max_size)
    sizes = []
    s = _MIN_TOKEN_SIZE
    while s < min(max_tokens, _TOKEN_FINE_FROM):
        sizes.append(s)
        s *= 2
    octave = _TOKEN_FINE_FROM
    while octave < max_tokens:
        sizes.extend(x for x in range(octave, 2 * octave, octave // 4) if x < max_tokens)
        octave *= 2
    sizes.append(max_tokens)
    return sorted(set(sizes))


def capture_sizes(max_num_seqs: int, max_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Powers of two (1, 2, 4, ..., 256) below the cap min(max_num_seqs, max_size), then the cap itself,
    so every decode batch the scheduler can form has a graph."""
    cap = max(1, min(max_num_seqs, max_size))
    sizes = []
    s = 1
    while s < cap:
        sizes.append(s)
        s *= 2
    sizes.append(cap)
    return sizes


def graph_sizes(graph_config, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[list[int], list[int]]:
    """(mixed-batch token counts, decode batch sizes) to capture, from a GraphConfig (graph_config.py)."""
    mixed = token_capture_sizes(max_num_batched_tokens) if graph_config.mixed_graphs else []
    return mixed, graph_config.decode_buckets(capture_sizes(max_num_seqs), max_num_seqs)


class CudaGraphRunner:
    """Graphs of ``forward(size) -> hidden [tokens, H]``, one per bucket (a padded batch or token count).

    ``forward`` must read its inputs only from buffers whose addresses never change (the static views),
    and the caller must have written a step's inputs there before ``replay``. With ``capture=False``
    nothing is captured and ``replay`` runs ``forward`` eagerly over the same padded static inputs: the
    padded path can then be tested where CUDA graphs do not exist (the CPU, Triton's interpreter).
    """

    def __init__(self, sizes: list[int], capture: bool = True) -> None:
        self.sizes = sorted(set(sizes))
        self.capture_enabled = capture
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._forward: Callable[[int], torch.Tensor] | None = None
        self.pool = None
        self.pool_bytes = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` (requests or tokens), or None when ``n`` is too large."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def capture(
        self,
        forward: Callable[[int], torch.Tensor],
        prepare_inputs: Callable[[int], None],
        pool=None,
    ) -> float:
        """Warms up and captures every bucket, largest first so the smaller ones reuse its memory pool.

        ``prepare_inputs(size)`` writes a harmless padded batch into the static views. ``pool``: a memory
        pool shared with other runners' graphs (they never replay at once); a new one by default.
        Returns seconds.
        """
        self._forward = forward
        t0 = time.perf_counter()
        if not self.capture_enabled:
            return 0.0
        reserved0 = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        self.pool = pool
        warm = warm_up_sizes(self.sizes)
        for size in reversed(self.sizes):
            prepare_inputs(size)
            if size in warm:
                forward(size)  # eager: Triton compiles this size's variants outside the capture
                torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward(size)
            self._graphs[size] = graph
            self._outputs[size] = out
        torch.cuda.synchronize()
        self.pool_bytes = torch.cuda.memory_reserved() - reserved0
        return time.perf_counter() - t0

    def replay(self, size: int) -> torch.Tensor:  # -> [tokens, H], valid until the next replay
        if not self.capture_enabled:
            assert self._forward is not None, "capture() was never called"
            return self._forward(size)
        self._graphs[size].replay()
        return self._outputs[size]

    def clear(self) -> None:
        self._graphs.clear()
        self._outputs.clear()
