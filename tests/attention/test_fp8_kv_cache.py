"""A float8 KV cache (``kv_cache_dtype="fp8"``): every backend writes and reads it like torch_ref, and the
engine sizes, allocates and runs it."""
from __future__ import annotations

import pytest
import torch
from paged_batches import build_paged_batch
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backends import cpu as cpu_backend
from pagedllm.attention.backends import torch_ref
from pagedllm.engine_args import EngineArgs

_ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if _ON_GPU else "cpu")
FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_torch_ref_write_saturates_and_rounds_like_torch(cache_dtype):
    # In range: torch's own rounding; beyond the largest finite value: that value, not inf or NaN.
    fmax = torch.finfo(cache_dtype).max
    key = torch.tensor([[[0.3, -7.95, 2 * fmax, -3 * fmax]]])  # [T=1, Hkv=1, D=4]
    cache = torch.zeros(2, 2, 4, 1, 4, dtype=cache_dtype)
    torch_ref.write_kv_cache(key, -key, cache, torch.tensor([5]))
    k = cache[0].view(-1, 1, 4)[5, 0].float()
    expected = torch.tensor([0.3, -7.95]).to(cache_dtype).float().tolist() + [fmax, -fmax]
    assert k.tolist() == expected
    assert cache[1].view(-1, 1, 4)[5, 0].float().tolist() == [-x for x in expected]
    assert not _bytes(cache).view(2, -1, 4)[:, :5].any()  # nothing else written


@pytest.mark.parametrize("cache_dtype", FP8)
def test_cpu_backend_matches_torch_ref_on_a_float8_cache(cache_dtype):
    # Decodes, a chunk with a cached prefix, and one without: the CPU backend's shortcut of reading the
    # step's own keys must see them rounded as the cache holds them.
    reqs = [(0, 19), (37, 12), (40, 1), (0, 1), (95, 1)]
    query, key, value, kv_cache, _, metadata = build_paged_batch(reqs, 4, 2, 64, 16, torch.float32, 3,
                                                                 cache_dtype=cache_dtype)
    ref_cache, cpu_cache = kv_cache.clone(), kv_cache.clone()
    expected = torch_ref.TorchRefImpl(4, 64, 0.125, 2).forward(query, key, value, ref_cache, metadata())
    got = cpu_backend.CpuAttentionImpl(4, 64, 0.125, 2).forward(query, key, value, cpu_cache, metadata())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(_bytes(cpu_cache), _bytes(ref_cache))
    # The cache really holds float8: attending over the unrounded keys gives something else.
    full = torch_ref.TorchRefImpl(4, 64, 0.125, 2).forward(query, key, value, kv_cache.float(), metadata())
    assert not torch.allclose(full, expected, atol=1e-3)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize(
    "reqs,dtype,num_splits,pad",
    [
        pytest.param([(37, 12), (0, 70), (20, 1)], torch.float16, 1, 2, id="mixed-prefix"),
        pytest.param([(40, 1), (0, 1), (95, 1), (17, 1)], torch.float32, 1, 0, id="decode-fused-write"),
        pytest.param([(150, 1), (70, 1), (3, 1)], torch.float16, 3, 1, id="split-decode"),
    ],
)
def test_triton_reads_and_writes_a_float8_cache_like_torch_ref(cache_dtype, reqs, dtype, num_splits, pad):
    triton_backend = pytest.importorskip("pagedllm.attention.backends.triton")
    # Interpreted, new keys lie on the float8 grid (the interpreter's rounding is wrong); on a GPU they
    # are arbitrary, and the bytes written must match torch's rounding exactly.
    query, key, value, kv_cache, poisoned, metadata = build_paged_batch(
        reqs, 4, 2, 64, 16, dtype, 5, pad, device=DEVICE, cache_dtype=cache_dtype, kv_on_cache_grid=not _ON_GPU
    )
    md = metadata()
    expected = torch_ref.TorchRefImpl(4, 64, 0.125, 2).forward(query, key, value, kv_cache, md)
    impl = triton_backend.TritonImpl(4, 64, 0.125, 2)
    impl.num_splits = num_splits
    out = impl.forward(query, key, value, poisoned, metadata())
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tol)
    written = md.slot_mapping[md.slot_mapping >= 0]
    for kv in range(2):
        assert torch.equal(_bytes(poisoned[kv].view(-1, 2, 64)[written]), _bytes(kv_cache[kv].view(-1, 2, 64)[written]))


@pytest.mark.parametrize("model", ["llama", "gemma3"])  # gemma3: sliding-window layers and soft caps
def test_kv_cache_dtype_sizes_the_cache_and_runs(model, tmp_path):
    path = make_tiny_model(model, tmp_path / model)
    budget = 1 << 22
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 30, 3)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12, detokenize=False)
    tokens, blocks = {}, {}
    for cache_dtype, backend in (("auto", "cpu"), ("fp8", "cpu"), ("fp8", "torch_ref"), ("fp8_e5m2", "cpu")):
        llm = LLM(model=path, skip_tokenizer_init=True, device="cpu", dtype="float32", max_model_len=128,
                  kv_cache_memory_bytes=budget, kv_cache_dtype=cache_dtype, attention_backend=backend)
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        blocks[cache_dtype] = llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool.num_blocks
        tokens[cache_dtype, backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if cache_dtype.startswith("fp8"):
            expected = torch.float8_e5m2 if cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
            assert runner.kv_caches[0].dtype == expected
        llm.llm_engine.engine_core.shutdown()
    # One byte an element instead of float32's four: four times the blocks in the same memory (each
    # count rounded down to whole blocks).
    assert blocks["fp8"] == blocks["fp8_e5m2"]
    assert 4 * blocks["auto"] <= blocks["fp8"] < 4 * (blocks["auto"] + 1)
    assert tokens["fp8", "cpu"] == tokens["fp8", "torch_ref"]
    assert all(len(t) == 12 for t in tokens["fp8", "cpu"])


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2; got 'int8'"):
        EngineArgs(model="unused", kv_cache_dtype="int8").create_engine_config()
