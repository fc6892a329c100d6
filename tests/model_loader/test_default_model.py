"""The default model's path: assembled once into the cache, reused after, and a clear error without its package."""
from __future__ import annotations

import os
import sys

import pytest

from pagedllm import envs
from pagedllm.model_loader import default_model as dm


def test_missing_package_names_the_extra(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(envs, "PAGEDLLM_CACHE", tmp_path)
    monkeypatch.setitem(sys.modules, dm.PACKAGE, None)  # makes the import fail as if not installed
    with pytest.raises(RuntimeError) as info:
        dm.default_model_path()
    message = str(info.value)
    assert "pip install 'pagedllm[default-model]'" in message and "\n" not in message


def test_cache_dir_follows_the_setting(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(envs, "PAGEDLLM_CACHE", tmp_path / "c")
    assert dm.cache_dir() == tmp_path / "c"


def test_a_cached_file_is_returned_without_the_package(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(envs, "PAGEDLLM_CACHE", tmp_path)
    (tmp_path / dm.MODEL_FILE).write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, dm.PACKAGE, None)
    assert dm.default_model_path() == str(tmp_path / dm.MODEL_FILE)


def test_assembles_once_atomically(tmp_path, monkeypatch) -> None:
    pkg = pytest.importorskip(dm.PACKAGE)
    monkeypatch.setattr(envs, "PAGEDLLM_CACHE", tmp_path)
    path = dm.default_model_path()
    assert path == str(tmp_path / dm.MODEL_FILE) and pkg.MODEL_NAME == dm.MODEL_FILE
    assert os.listdir(tmp_path) == [dm.MODEL_FILE]  # no partial file left behind
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    stamp = os.stat(path).st_mtime_ns
    monkeypatch.setattr(pkg, "assemble", lambda *a, **k: pytest.fail("assembled twice"))
    assert dm.default_model_path() == path and os.stat(path).st_mtime_ns == stamp


def test_failed_assembly_leaves_nothing(tmp_path, monkeypatch) -> None:
    pkg = pytest.importorskip(dm.PACKAGE)
    monkeypatch.setattr(envs, "PAGEDLLM_CACHE", tmp_path)

    def broken(output_path, overwrite=False):
        with open(output_path, "wb") as f:
            f.write(b"GGUF half")
        raise ValueError("Assembled file sha256 did not match expected value")

    monkeypatch.setattr(pkg, "assemble", broken)
    with pytest.raises(ValueError, match="sha256"):
        dm.default_model_path()
    assert os.listdir(tmp_path) == []
