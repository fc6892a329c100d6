"""Every ``PAGEDLLM_*`` environment variable pagedllm reads: its default and meaning, read once, at import.

No other module reads a ``PAGEDLLM_*`` variable: each reads the attribute here (``envs.PAGEDLLM_PDL``)
at the time it needs it, so a test changes a switch with ``monkeypatch.setattr(envs, ...)``. A process
that pagedllm starts (the engine core, a server) imports this module afresh and so sees the environment
it was started with. The README's table lists the same variables (a test keeps the two in step).
"""
from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str, default: bool) -> bool:
    # Only "0" and "1" are meaningful; anything else is a typo that would silently pick a side.
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"environment variable {name}={value!r}: expected 0 or 1")
    return value == "1"


def _path(name: str, default: Path) -> Path:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else default


# Name -> one-line description, for the README table and its test.
DOCS: dict[str, str] = {
    "PAGEDLLM_CACHE": "where pagedllm keeps files it builds (the default model, converted GGUF weights and "
                      "tokenizers); default `~/.cache/pagedllm/models`",
    "PAGEDLLM_API_KEY": "one more key `pagedllm serve` accepts, beside `--api-key`; default none",
    "PAGEDLLM_GC_FREEZE": "`0` leaves a started engine's objects in the garbage collector's full collections; "
                          "default `1` (frozen until shutdown)",
    "PAGEDLLM_PDL": "`0` turns off programmatic dependent launch of the Triton kernels; default `1` (on for GPUs "
                    "of compute capability 9.0 and up)",
    "PAGEDLLM_RAY_PLACEMENT_STRATEGY": "how the Ray executor's placement group spreads the ranks over a Ray "
                                       "cluster's nodes: `PACK`, `SPREAD`, `STRICT_PACK` or `STRICT_SPREAD`; "
                                       "default `PACK`",
}

PAGEDLLM_CACHE: Path = _path("PAGEDLLM_CACHE", Path.home() / ".cache" / "pagedllm" / "models")
PAGEDLLM_API_KEY: str | None = os.environ.get("PAGEDLLM_API_KEY") or None
PAGEDLLM_GC_FREEZE: bool = _flag("PAGEDLLM_GC_FREEZE", True)
PAGEDLLM_PDL: bool = _flag("PAGEDLLM_PDL", True)
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
PAGEDLLM_RAY_PLACEMENT_STRATEGY: str = os.environ.get("PAGEDLLM_RAY_PLACEMENT_STRATEGY") or "PACK"
if PAGEDLLM_RAY_PLACEMENT_STRATEGY not in RAY_PLACEMENT_STRATEGIES:
    raise ValueError(f"environment variable PAGEDLLM_RAY_PLACEMENT_STRATEGY={PAGEDLLM_RAY_PLACEMENT_STRATEGY!r}: "
                     f"expected one of {', '.join(RAY_PLACEMENT_STRATEGIES)}")
