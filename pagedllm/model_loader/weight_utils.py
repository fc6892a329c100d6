"""Finds and reads checkpoint tensors (safetensors, single or sharded, or PyTorch ``*.bin``) as (name, tensor) pairs."""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Sequence

import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
PT_INDEX = "pytorch_model.bin.index.json"
# Non-weight files that share the checkpoint's extension in some repos.
_PT_IGNORE = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth")


def _files_from_index(model_dir: str, index_name: str) -> list[str] | None:
    index_path = os.path.join(model_dir, index_name)
    if not os.path.isfile(index_path):
        return None
    with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]


def find_weight_files(model_path: str, load_format: str = "auto") -> tuple[list[str], str]:
    """The checkpoint files to read and their format (``"safetensors"`` or ``"pt"``).

    ``auto`` prefers safetensors and falls back to ``*.bin``. A sharded checkpoint is read through
    its index so stray extra files in the directory (e.g. a consolidated copy) are not loaded twice.
    """
    if load_format not in ("auto", "safetensors", "pt"):
        raise ValueError(f"load_format must be auto, safetensors or pt here, got {load_format!r}")
    if os.path.isfile(model_path):
        fmt = "safetensors" if model_path.endswith(".safetensors") else "pt"
        if load_format != "auto" and fmt != load_format:
            raise ValueError(f"{model_path} is not a {load_format} checkpoint")
        return [model_path], fmt

    if load_format in ("auto", "safetensors"):
        files = _files_from_index(model_path, SAFETENSORS_INDEX)
        if files is None:
            files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
        if files:
            return files, "safetensors"
    if load_format in ("auto", "pt"):
        files = _files_from_index(model_path, PT_INDEX)
        if files is None:
            files = sorted(
                p
                for pattern in ("*.bin", "*.pt", "*.pth")
                for p in glob.glob(os.path.join(model_path, pattern))
                if os.path.basename(p) not in _PT_IGNORE
            )
        if files:
            return files, "pt"
    wanted = {"auto": "*.safetensors or *.bin", "safetensors": "*.safetensors", "pt": "*.bin"}[load_format]
    raise FileNotFoundError(f"no {wanted} weight files found in {model_path}")


def safetensors_weights_iterator(files: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def pt_weights_iterator(files: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        # weights_only: a checkpoint from the hub must not be able to run code on load.
        state = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        yield from state.items()
        del state


def iterate_weights(
    model_path: str, load_format: str = "auto", lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the checkpoint at ``model_path``, on the CPU, one file at a time. ``lazy``: safetensors
    tensors come as ``LazyWeight``s, read only in the part a weight loader keeps (a tensor-parallel rank's shard)."""
    files, fmt = find_weight_files(model_path, load_format)
    if fmt == "safetensors":
        if lazy:
            from pagedllm.model_loader.lazy_weights import lazy_safetensors_iterator

            return lazy_safetensors_iterator(files)
        return safetensors_weights_iterator(files)
    return pt_weights_iterator(files)
