"""Checkpoint tensors read on demand, so a tensor-parallel rank reads only its own rows of each weight.

``LazyWeight`` stands for a safetensors tensor not read yet. ``narrow``, ``split`` and slicing of the
first dimension (what the layers' weight loaders do to take a rank's shard) only narrow the region; any
other use (``param.copy_(w)``, ``w.float()``, a torch function) reads that region from the file then.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class LazyWeight:
    """A region (one range per dimension) of a tensor in an open safetensors file."""

    def __init__(self, source, ranges: list[tuple[int, int]], dtype: torch.dtype | None) -> None:
        self._source = source  # safetensors' slice object for the whole tensor
        self._ranges = ranges
        self.dtype = dtype

    @classmethod
    def of(cls, source) -> LazyWeight:
        return cls(source, [(0, n) for n in source.get_shape()], _DTYPES.get(source.get_dtype()))

    @property
    def shape(self) -> torch.Size:
        return torch.Size(end - start for start, end in self._ranges)

    def dim(self) -> int:
        return len(self._ranges)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def narrow(self, dim: int, start: int, length: int) -> LazyWeight:
        dim = dim % self.dim()
        lo, hi = self._ranges[dim]
        if start < 0 or length < 0 or lo + start + length > hi:
            raise IndexError(f"narrow({dim}, {start}, {length}) is outside a dimension of size {hi - lo}")
        ranges = list(self._ranges)
        ranges[dim] = (lo + start, lo + start + length)
        return LazyWeight(self._source, ranges, self.dtype)

    def split(self, sizes: int | Sequence[int], dim: int = 0) -> tuple[LazyWeight, ...]:
        total = self.shape[dim]
        if isinstance(sizes, int):
            sizes = [min(sizes, total - s) for s in range(0, total, sizes)]
        if sum(sizes) != total:
            raise ValueError(f"split sizes {list(sizes)} do not add up to the dimension's {total}")
        out, start = [], 0
        for n in sizes:
            out.append(self.narrow(dim, start, n))
            start += n
        return tuple(out)

    def __getitem__(self, index):
        if isinstance(index, slice) and index.step in (None, 1) and self.dim() > 0:
            start, stop, _ = index.indices(self.shape[0])
            return self.narrow(0, start, max(stop - start, 0))
        return self.materialize()[index]

    def materialize(self) -> torch.Tensor:
        """The region, read from the file."""
        if not self._ranges:
            return self._source[()]
        return self._source[tuple(slice(a, b) for a, b in self._ranges)]

    def __getattr__(self, name: str):
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(a):
            if isinstance(a, LazyWeight):
                return a.materialize()
            if isinstance(a, (list, tuple)):
                return type(a)(real(x) for x in a)
            return a

        return func(*real(args), **{k: real(v) for k, v in (kwargs or {}).items()})

    def __repr__(self) -> str:
        return f"LazyWeight(shape={tuple(self.shape)}, dtype={self.dtype})"


def lazy_safetensors_iterator(files: Sequence[str]) -> Iterator[tuple[str, LazyWeight]]:
    """Every tensor of the files as a ``LazyWeight``, valid until the iterator moves to the next file."""
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, LazyWeight.of(f.get_slice(name))
