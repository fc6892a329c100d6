"""Turns a model argument into a local path: a local directory or file as is, otherwise a Hugging Face hub snapshot."""
from __future__ import annotations

import json
import os

_META_PATTERNS = ["*.json", "*.model", "*.tiktoken", "tokenizer*", "merges.txt", "vocab.txt"]
_PT_IGNORE = ["training_args.bin", "optimizer.bin", "*.msgpack", "*.h5"]
_TRUTHY = {"1", "true", "yes", "on"}


def _offline() -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE once at import; honour a later change of the variable too.
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return env.strip().lower() in _TRUTHY or bool(constants.HF_HUB_OFFLINE)


def _download(model: str, download_dir: str | None) -> str:
    from huggingface_hub import snapshot_download

    kwargs = dict(repo_id=model, cache_dir=download_dir, local_files_only=_offline())
    path = snapshot_download(allow_patterns=_META_PATTERNS, **kwargs)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        # Only the shards the index names: some repos also ship a consolidated copy of the same weights.
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return snapshot_download(allow_patterns=shards, **kwargs)
    path = snapshot_download(allow_patterns=["*.safetensors"], **kwargs)
    if any(name.endswith(".safetensors") for name in os.listdir(path)):
        return path
    return snapshot_download(allow_patterns=["*.bin", "*.pt"], ignore_patterns=_PT_IGNORE, **kwargs)


def resolve_model_path(model: str, download_dir: str | None = None) -> str:
    """A local directory or file holding the model's config, tokenizer and weights.

    Raises RuntimeError with a one-line reason when ``model`` is neither a local path nor a
    reachable hub repository.
    """
    local = os.path.expanduser(model)
    if os.path.exists(local):
        return local
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return _download(model, download_dir)
    except HFValidationError:
        raise RuntimeError(f"model {model!r} is neither an existing local path nor a valid hub repository id") from None
    except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise RuntimeError(
            f"model {model!r} is not a local path and the hub has no accessible repository of that name "
            f"({type(e).__name__}: missing, private or gated)"
        ) from None
    except Exception as e:  # connection errors, offline mode, nothing cached: all mean "hub unreachable"
        raise RuntimeError(
            f"model {model!r} is not a local path and the Hugging Face hub could not be reached to download it "
            f"({type(e).__name__}); pass a local model directory or enable network access"
        ) from None
