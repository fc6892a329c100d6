"""engine/heap.py: a started engine's objects leave the collector's full collections; shutdown gives them back."""
from __future__ import annotations

import gc
import weakref

from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams, envs


def _llm(path):
    return LLM(model=path, skip_tokenizer_init=True, max_num_seqs=4, max_model_len=128, seed=0, device="cpu",
               dtype="float32", kv_cache_memory_bytes=1 << 22)


def test_engine_freezes_its_start_up_heap_and_shutdown_releases_it(tmp_path):
    path = make_tiny_model("qwen3", tmp_path / "qwen3")
    gc.unfreeze()
    llm = _llm(path)
    model = weakref.ref(llm.llm_engine.engine_core.executor.worker.model_runner.model)
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # the imported modules and the model's objects, at least
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=4, ignore_eos=True,
                                                                        detokenize=False), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    llm.llm_engine.engine_core.shutdown()
    assert gc.get_freeze_count() == 0
    del llm, out
    gc.collect()
    assert model() is None


def test_freezing_can_be_turned_off(tmp_path, monkeypatch):
    path = make_tiny_model("llama", tmp_path / "llama")
    gc.unfreeze()
    monkeypatch.setattr(envs, "PAGEDLLM_GC_FREEZE", False)
    llm = _llm(path)
    assert gc.get_freeze_count() == 0
    llm.llm_engine.engine_core.shutdown()


def test_trim_heap_gives_freed_heap_pages_back(tmp_path):
    """200 MiB of small C allocations freed but the last (which pins the heap's top, as a tokenizer's parse
    leaves it): glibc keeps the pages until trim_heap returns them."""
    import ctypes
    import sys

    import psutil
    import pytest

    from pagedllm.engine.heap import trim_heap

    if not sys.platform.startswith("linux"):
        pytest.skip("malloc_trim is glibc's")
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = []
    for _ in range(200 * 1024):
        p = libc.malloc(1024)
        ctypes.memset(p, 1, 1024)  # touched: resident
        blocks.append(p)
    for p in blocks[:-1]:
        libc.free(p)
    before = psutil.Process().memory_info().rss
    trim_heap()
    after = psutil.Process().memory_info().rss
    libc.free(blocks[-1])
    assert before - after > 150 * 2**20, (before, after)
