"""Opening a GGUF file: a faster gguf-py reader over its memory map, and the architectures pagedllm can run from one."""
from __future__ import annotations

import inspect
import os
import struct
from typing import Any

import numpy as np

# general.architecture -> (HF model_type, HF architectures entry). Gemma 3 GGUFs hold only the text model.
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
# Mixture-of-experts architectures of their own, and those llama.cpp writes under a dense name with
# ``{arch}.expert_count`` set (Mixtral is ``llama`` with experts).
MOE_ARCHITECTURES = frozenset({"qwen2moe", "qwen3moe"})
WITH_EXPERTS: dict[str, tuple[str, str]] = {"llama": ("mixtral", "MixtralForCausalLM")}


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata field's value, or ``default`` when the file lacks it."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_architecture(reader: Any, arch: str) -> tuple[str, str]:
    """(HF model_type, HF architectures entry) of a file of ``general.architecture`` ``arch`` (one of ARCHITECTURES)."""
    if arch in WITH_EXPERTS and int(field_value(reader, f"{arch}.expert_count", 0) or 0) > 0:
        return WITH_EXPERTS[arch]
    return ARCHITECTURES[arch]


def supported_architectures() -> str:
    """The architectures pagedllm runs from a GGUF file, for error messages."""
    dense = sorted(set(ARCHITECTURES) - MOE_ARCHITECTURES)
    moe = sorted(MOE_ARCHITECTURES | {f"{a} with {a}.expert_count ({hf})" for a, (_, hf) in WITH_EXPERTS.items()})
    return f"{', '.join(dense)}; with experts: {', '.join(moe)}"


def _fast_reader_class() -> type:
    """gguf.GGUFReader, made several times faster at parsing metadata when its internals allow.

    The reader slices its ``np.memmap`` once per value; memmap's Python-level ``__getitem__`` and
    ``__array_finalize__`` then dominate a 262k-token vocabulary (11 s -> 3.5 s for Gemma 3). Slicing a
    plain ndarray view of the same mapping gives the same values (and tensor views) without that cost, and
    reading arrays whole rather than item by item takes Gemma 3's metadata to about a second.
    """
    from gguf import GGUFReader, GGUFValueType

    def params(name: str) -> list[str]:
        return list(inspect.signature(getattr(GGUFReader, name)).parameters) if hasattr(GGUFReader, name) else []

    if (params("_get") != ["self", "offset", "dtype", "count", "override_order"]
            or params("_get_field_parts") != ["self", "orig_offs", "raw_type"]):
        return GGUFReader  # a gguf-py whose internals differ: keep its own, slower, parsing

    class _FastGGUFReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain_data")
            if plain is None:
                plain = self._plain_data = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs, raw_type):
            # gguf-py reads an array item by item (two reads per string); the vocabulary's 262k strings, scores
            # and types then cost seconds. The same parts, views of the same bytes, come from one read per
            # scalar array and one slice per string.
            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            count = self._get(orig_offs + 4, np.uint64)
            itype, n, offs = GGUFValueType(int(raw_itype[0])), int(count[0]), orig_offs + 12
            parts: list = [raw_itype, count]
            if n == 0:
                return offs - orig_offs, parts, [], [GGUFValueType.ARRAY]
            plain = self.__dict__.get("_plain_data")
            if plain is None:
                plain = self._plain_data = self.data.view(np.ndarray)
            if itype == GGUFValueType.STRING:
                buf = memoryview(plain)
                for _ in range(n):  # each item: a u64 length, then its bytes
                    length = struct.unpack_from("=Q", buf, offs)[0]
                    parts.append(plain[offs : offs + 8].view(np.uint64))
                    parts.append(plain[offs + 8 : offs + 8 + length])
                    offs += 8 + length
                return offs - orig_offs, parts, list(range(3, 2 + 2 * n, 2)), [GGUFValueType.ARRAY, itype]
            if itype in self.gguf_scalar_to_np:
                dtype = np.dtype(self.gguf_scalar_to_np[itype])
                items = plain[offs : offs + n * dtype.itemsize].view(dtype)
                parts += list(items.reshape(n, 1))
                return n * dtype.itemsize + 12, parts, list(range(2, 2 + n)), [GGUFValueType.ARRAY, itype]
            return super()._get_field_parts(orig_offs, raw_type)

    return _FastGGUFReader


def _tensor_index_class() -> type:
    """The fast reader, skipping the items of array fields (a 262k-token vocabulary's strings, scores and types):
    for a caller that wants the tensors and scalar fields only, the metadata costs a walk over string lengths
    instead of an object per item. Array fields are kept with their item type and length, and no items."""
    from gguf import GGUFValueType

    base = _fast_reader_class()
    params = list(inspect.signature(base._get_field_parts).parameters)
    if base.__name__ != "_FastGGUFReader" or params != ["self", "orig_offs", "raw_type"]:
        return base  # internals differ: parse everything

    class _TensorIndexReader(base):
        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            count = self._get(orig_offs + 4, np.uint64)
            itype, offs = GGUFValueType(int(raw_itype[0])), orig_offs + 12
            if itype == GGUFValueType.STRING:
                plain = memoryview(self.data.view(np.ndarray))
                for _ in range(int(count[0])):  # each item: a u64 length, then its bytes
                    offs += 8 + struct.unpack_from("<Q", plain, offs)[0]
            elif itype in self.gguf_scalar_to_np:
                offs += int(count[0]) * np.dtype(self.gguf_scalar_to_np[itype]).itemsize
            else:  # arrays of arrays: rare, and walked in full
                return super()._get_field_parts(orig_offs, raw_type)
            return offs - orig_offs, [raw_itype, count], [], [GGUFValueType.ARRAY, itype]

    return _TensorIndexReader


def open_gguf(path: str | os.PathLike, skip_arrays: bool = False) -> Any:
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped: tensor bytes are read when touched).

    ``skip_arrays``: array fields (the tokenizer's vocabulary) hold no items, for callers that read tensors and
    scalar fields only; a fraction of the time on a large vocabulary."""
    from gguf import GGUFEndian

    reader = (_tensor_index_class() if skip_arrays else _fast_reader_class())(os.fspath(path))
    if reader.endianess != GGUFEndian.LITTLE:
        raise ValueError(f"{path} is a big-endian GGUF; only little-endian files are supported")
    return reader
