"""A converted copy of a GGUF file (config.json + float32 safetensors) so later starts skip parsing and dequantizing."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

logger = logging.getLogger("pagedllm")

_FORMAT = "1"  # bump when the converted layout changes
_DONE = "CONVERTED"


def converted_dir(gguf_path: str | os.PathLike) -> Path:
    """Where the conversion of this exact file (path, size, mtime) lives."""
    from pagedllm.model_loader.default_model import cache_dir

    path = os.path.realpath(os.fspath(gguf_path))
    st = os.stat(path)
    ident = "\0".join([path, str(st.st_size), str(st.st_mtime_ns), _FORMAT])
    return cache_dir() / "converted" / hashlib.sha256(ident.encode()).hexdigest()[:24]


def find_converted(gguf_path: str | os.PathLike) -> Path | None:
    entry = converted_dir(gguf_path)
    return entry if (entry / _DONE).is_file() else None


def store_converted(gguf_path: str | os.PathLike, hf_config: Any, weights: dict[str, torch.Tensor]) -> None:
    """Writes the entry atomically (staging dir, then rename); a failure only costs the speed-up."""
    from safetensors.torch import save_file

    entry = converted_dir(gguf_path)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=entry.parent))
        hf_config.to_json_file(str(staging / "config.json"))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(staging / "model.safetensors"))
        (staging / _DONE).write_text(os.fspath(gguf_path))
        try:
            os.rename(staging, entry)
        except OSError:  # another process converted it first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        logger.warning("could not cache the converted GGUF weights at %s: %s", entry, e)


def tee_float32(weights: Iterable[tuple[str, torch.Tensor]], sink: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes weights through while keeping float32 CPU copies in ``sink``."""
    for name, w in weights:
        sink[name] = w.detach().to("cpu", torch.float32)
        yield name, w
