"""vLLM's ``compilation_config`` as far as it applies here: which CUDA graphs the runner captures.

pagedllm compiles nothing with torch.compile; its graphs are whole forward passes of two families,
pure-decode batches padded to a request count and mixed batches padded to a token count
(worker/cuda_graphs.py). A vLLM user's ``compilation_config`` (a dict, a JSON string, or an int for
the optimisation level) therefore maps onto three choices:

- ``cudagraph_capture_sizes``: the decode batch sizes that get a graph (those up to ``max_num_seqs``;
  larger batches run eagerly, as in vLLM). Default: powers of two up to ``max_num_seqs``, and it.
- ``max_cudagraph_capture_size``: no decode graph above this size.
- ``cudagraph_mode``: ``NONE`` captures nothing (as ``enforce_eager``), ``FULL_DECODE_ONLY`` only the
  decode graphs; ``FULL``, ``PIECEWISE`` and ``FULL_AND_PIECEWISE`` capture both families.

vLLM's other keys (the optimisation level, inductor and custom-op settings) have no effect here and are
accepted with a log line, so that a vLLM configuration starts unchanged; an unknown key is an error.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("pagedllm")

CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
# vLLM CompilationConfig fields about torch.compile and its passes: nothing here to apply them to.
_NO_EFFECT_KEYS = frozenset({
    "level", "mode", "backend", "custom_ops", "splitting_ops", "use_inductor", "compile_sizes",
    "inductor_compile_config", "inductor_passes", "pass_config", "use_cudagraph", "cudagraph_num_of_warmups",
    "cudagraph_copy_inputs", "full_cuda_graph", "debug_dump_path", "cache_dir", "compile_cache_save_format",
    "use_inductor_graph_partition", "cudagraph_specialize_lora", "local_cache_dir", "compile_mm_encoder",
    "dynamic_shapes_config", "static_forward_context",
})


@dataclass(frozen=True)
class GraphConfig:
    """What the model runner captures (when graphs are possible at all: CUDA, no ``enforce_eager``)."""

    decode_sizes: tuple[int, ...] | None = None  # None: the runner's default buckets
    max_decode_size: int | None = None
    decode_graphs: bool = True
    mixed_graphs: bool = True

    def decode_buckets(self, default: list[int], max_num_seqs: int) -> list[int]:
        """The decode batch sizes to capture, given the runner's default list for ``max_num_seqs``."""
        if not self.decode_graphs:
            return []
        sizes = sorted(set(self.decode_sizes)) if self.decode_sizes is not None else default
        cap = max_num_seqs if self.max_decode_size is None else min(max_num_seqs, self.max_decode_size)
        return [s for s in sizes if s <= cap]


def parse_compilation_config(value: Any) -> GraphConfig:
    """A GraphConfig from vLLM's ``compilation_config``: None, an int level, a dict, or their JSON text."""
    if value is None:
        return GraphConfig()
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text) if text.lstrip("-").isdigit() else json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"compilation_config {value!r} is neither an integer level nor JSON: {e}") from None
    if isinstance(value, bool) or not isinstance(value, (int, dict)):
        raise ValueError(f"compilation_config must be an int level, a dict or its JSON text; got {value!r}")
    if isinstance(value, int):
        logger.info("compilation_config level %d has no effect: pagedllm does not use torch.compile", value)
        return GraphConfig()
    unknown = sorted(k for k in value if k not in _NO_EFFECT_KEYS and k not in (
        "cudagraph_capture_sizes", "max_cudagraph_capture_size", "cudagraph_mode"))
    if unknown:
        raise ValueError(
            f"compilation_config key {unknown[0]!r} is unknown; the ones that apply here are "
            "cudagraph_capture_sizes, max_cudagraph_capture_size and cudagraph_mode"
        )
    ignored = sorted(k for k in value if k in _NO_EFFECT_KEYS)
    if ignored:
        logger.info("compilation_config keys with no effect in pagedllm (no torch.compile): %s", ", ".join(ignored))
    sizes = value.get("cudagraph_capture_sizes")
    if sizes is not None:
        if not isinstance(sizes, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
            raise ValueError(f"compilation_config cudagraph_capture_sizes must be a list of ints; got {sizes!r}")
        bad = [s for s in sizes if s < 1]
        if bad:
            raise ValueError(f"compilation_config cudagraph_capture_sizes holds {bad[0]}; sizes must be >= 1")
        sizes = tuple(sorted(set(sizes)))
    max_size = value.get("max_cudagraph_capture_size")
    if max_size is not None and (isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 0):
        raise ValueError(f"compilation_config max_cudagraph_capture_size must be an int >= 0; got {max_size!r}")
    mode = value.get("cudagraph_mode", "FULL_AND_PIECEWISE")
    mode = mode.upper() if isinstance(mode, str) else mode
    if mode not in CUDAGRAPH_MODES:
        raise ValueError(f"compilation_config cudagraph_mode {mode!r} is not one of {', '.join(CUDAGRAPH_MODES)}")
    return GraphConfig(
        decode_sizes=sizes,
        max_decode_size=max_size,
        decode_graphs=mode != "NONE" and max_size != 0,
        mixed_graphs=mode not in ("NONE", "FULL_DECODE_ONLY"),
    )
