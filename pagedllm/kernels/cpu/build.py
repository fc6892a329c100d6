"""Compiles a C kernel source at first use with the system C compiler into a per-user cache and loads it.

The shared library is named by a hash of the source (and the headers beside it), the flags and the compiler,
so an edited source or a new compiler builds afresh and stale builds are simply never loaded again. A build goes to a temporary file
beside its final name and is renamed into place, so concurrent processes never load a half-written file.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

_cache_dir: Path | None = None


class BuildError(RuntimeError):
    """The kernel could not be built or loaded here; the message says why."""


def set_cache_dir(path: str | os.PathLike) -> None:
    """Where later builds go (the engine passes a folder of its own cache); default ``cache_dir()``."""
    global _cache_dir
    _cache_dir = Path(path)


def cache_dir() -> Path:
    """``set_cache_dir``'s folder, else ``$XDG_CACHE_HOME/pagedllm/kernels`` (``~/.cache`` without it)."""
    if _cache_dir is not None:
        return _cache_dir
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base).expanduser() if base else Path.home() / ".cache") / "pagedllm" / "kernels"


def compiler() -> str | None:
    """Path of the system C compiler (``cc``, else ``gcc``, else ``clang``), or None."""
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


@functools.cache
def _compiler_version(cc: str) -> str:
    done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    return done.stdout


def build(source: Path, flags: tuple[str, ...]) -> ctypes.CDLL:
    """Load the shared library that ``cc <flags> source`` builds, building it first if not cached.

    Raises BuildError with the compiler's message when there is no compiler or the build fails."""
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler (cc, gcc or clang) on PATH")
    # The headers beside the source (which it may include) are part of what is built.
    text = b"\0".join([source.read_bytes(), *(h.read_bytes() for h in sorted(source.parent.glob("*.h")))])
    key = hashlib.sha256(b"\0".join([text, " ".join(flags).encode(), cc.encode(), _compiler_version(cc).encode()]))
    target = cache_dir() / f"{source.stem}-{key.hexdigest()[:20]}.so"
    if not target.is_file():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", prefix=f".{source.stem}-", dir=target.parent)
            os.close(fd)
        except OSError as e:
            raise BuildError(f"cannot write to the kernel cache {target.parent}: {e}") from None
        try:
            done = subprocess.run([cc, *flags, "-o", tmp, str(source)], capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise BuildError(f"{Path(cc).name} failed on {source.name}: {done.stderr.strip()[-2000:]}")
            os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide the build from other users of a shared cache
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        raise BuildError(f"cannot load {target}: {e}") from None


def load_vector_kernel(
    source: Path,
    flags: tuple[str, ...],
    declare: Callable[[ctypes.CDLL], ctypes.CDLL],
    unavailable: str,
    avx512_flags: tuple[str, ...] = (),
) -> ctypes.CDLL | None:
    """``build`` for a kernel that needs AVX2 + FMA (plus ``avx512_flags`` where torch runs AVX-512), its entry
    points given their signatures by ``declare``; None, logging once why and ``unavailable`` (what takes its
    place), where the CPU lacks the vectors or the build fails."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        reason = f"the CPU's vector capability is {capability}, the kernels need AVX2 and FMA"
    else:
        try:
            return declare(build(source, flags + (avx512_flags if capability == "AVX512" else ())))
        except BuildError as e:
            reason = str(e)
    logging.getLogger("pagedllm").warning("%s unavailable (%s): %s", source.name, reason, unavailable)
    return None
