"""Opening a GGUF file: a faster gguf-py reader over its memory map, and the architectures pagedllm can run from one."""
from __future__ import annotations

import inspect
import os
from typing import Any

import numpy as np

# general.architecture -> (HF model_type, HF architectures entry). Gemma 3 GGUFs hold only the text model.
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}


def _fast_reader_class() -> type:
    """gguf.GGUFReader, made several times faster at parsing metadata when its internals allow.

    The reader slices its ``np.memmap`` once per value; memmap's Python-level ``__getitem__`` and
    ``__array_finalize__`` then dominate a 262k-token vocabulary (11 s -> 3.5 s for Gemma 3). Slicing a
    plain ndarray view of the same mapping gives the same values (and tensor views) without that cost.
    """
    from gguf import GGUFReader

    params = list(inspect.signature(GGUFReader._get).parameters) if hasattr(GGUFReader, "_get") else []
    if params != ["self", "offset", "dtype", "count", "override_order"]:
        return GGUFReader  # a gguf-py whose internals differ: keep its own, slower, parsing

    class _FastGGUFReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain_data")
            if plain is None:
                plain = self._plain_data = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return _FastGGUFReader


def open_gguf(path: str | os.PathLike) -> Any:
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped: tensor bytes are read when touched)."""
    from gguf import GGUFEndian

    reader = _fast_reader_class()(os.fspath(path))
    if reader.endianess != GGUFEndian.LITTLE:
        raise ValueError(f"{path} is a big-endian GGUF; only little-endian files are supported")
    return reader
