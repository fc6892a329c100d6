"""Registry of attention backends by name, imported lazily so CPU installs never touch Triton."""
from __future__ import annotations

import importlib

from pagedllm.attention.backend import AttentionBackend

_BACKENDS: dict[str, tuple[str, str]] = {
    "cpu": ("pagedllm.attention.backends.cpu", "CpuAttentionBackend"),
    "torch_ref": ("pagedllm.attention.backends.torch_ref", "TorchRefBackend"),
    "triton": ("pagedllm.attention.backends.triton", "TritonBackend"),
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attn_backend(name: str | None, device_type: str) -> type[AttentionBackend]:
    """Returns the backend class; ``None`` picks Triton on CUDA, the CPU backend on CPU, else the reference."""
    if name is None or name == "auto":
        name = {"cuda": "triton", "cpu": "cpu"}.get(device_type, "torch_ref")
    if name not in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; choose one of {available_backends()}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)
