"""Triton attention on a real GPU: bf16/fp16 parity with torch_ref on realistic shapes, and CUDA-graph safety."""
from __future__ import annotations

import pytest
import torch
from paged_batches import build_paged_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = torch.device("cuda")


def _build(reqs, num_heads, num_kv_heads, head_size, block_size, dtype, seed, pad=0, cache_dtype=None):
    """A paged mixed batch with shuffled blocks on the GPU; ``reqs`` is (cached context, new tokens) per request."""
    query, key, value, kv_cache, _, metadata = build_paged_batch(
        reqs, num_heads, num_kv_heads, head_size, block_size, dtype, seed, pad, DEVICE, cache_dtype
    )
    return query, key, value, kv_cache, metadata()


def _compare(reqs, num_heads, num_kv_heads, head_size, block_size, dtype, *, window=None, soft_cap=None,
             num_splits=None, pad=0, seed=0, cache_dtype=None):
    from pagedllm.attention.backends.torch_ref import TorchRefImpl
    from pagedllm.attention.backends.triton import TritonImpl

    query, key, value, kv_cache, md = _build(reqs, num_heads, num_kv_heads, head_size, block_size, dtype, seed, pad,
                                             cache_dtype)
    scale = head_size**-0.5
    ref_cache = kv_cache.clone()
    expected = TorchRefImpl(num_heads, head_size, scale, num_kv_heads, window, soft_cap).forward(
        query, key, value, ref_cache, md
    )
    impl = TritonImpl(num_heads, head_size, scale, num_kv_heads, window, soft_cap)
    impl.num_splits = num_splits
    out = impl.forward(query, key, value, kv_cache, md)
    torch.cuda.synchronize()
    # Bytes: float8 has no torch.equal; every write must round (and saturate) exactly as torch_ref's.
    assert torch.equal(kv_cache.view(torch.uint8), ref_cache.view(torch.uint8)), "cache write differs from torch_ref"
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def _mixed_reqs(seed, num_decodes, max_ctx, chunks):
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, max_ctx, (num_decodes,), generator=gen).tolist()
    return [(c, 1) for c in ctx] + list(chunks)


DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama3_8b_mixed_batch(dtype):
    # 32 query / 8 KV heads, D=128: decodes of scattered lengths plus a fresh and a continued chunk.
    reqs = _mixed_reqs(1, 24, 3000, [(0, 512), (1000, 256), (37, 3)])
    _compare(reqs, 32, 8, 128, 16, dtype, pad=5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [None, 1, 16])
def test_few_long_decodes(dtype, num_splits):
    # None is the heuristic, which splits here; 1 and 16 pin both paths on the same data.
    reqs = [(8000, 1), (3000, 1), (12000, 1)]
    _compare(reqs, 32, 8, 128, 16, dtype, num_splits=num_splits, seed=2)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_float8_cache(cache_dtype, num_splits):
    # bf16 activations over a float8 cache (products in float16): a mixed batch (separate write, prompt keys
    # through the cache), then pure decode (fused write), split or not; values rounded on the GPU as torch
    # rounds them.
    reqs = _mixed_reqs(7, 20, 3000, [(0, 512), (1000, 256), (37, 3)])
    _compare(reqs, 32, 8, 128, 16, torch.bfloat16, num_splits=num_splits, pad=5, seed=11, cache_dtype=cache_dtype)
    _compare([(8000, 1), (300, 1), (2500, 1)], 32, 8, 128, 16, torch.bfloat16, num_splits=num_splits, seed=12,
             cache_dtype=cache_dtype)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_float8_cache_many_decodes(cache_dtype):
    # Enough decode programs for the one-warp, 32-key launch that a float8 cache takes on a large batch.
    from pagedllm.kernels.attention.launch_config import default_config

    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    n = 6 * sms // 8 + 7
    assert default_config(128, 4, 1, num_reqs=n, num_kv_heads=8, num_sms=sms, cache_bytes=1).num_warps == 1
    gen = torch.Generator().manual_seed(5)
    reqs = [(int(c), 1) for c in torch.randint(1, 900, (n,), generator=gen)]
    _compare(reqs, 32, 8, 128, 16, torch.bfloat16, seed=14, cache_dtype=cache_dtype)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_float8_cache_write_saturates_like_torch_ref(cache_dtype):
    from pagedllm.attention.backends.torch_ref import write_kv_cache
    from pagedllm.kernels.attention.reshape_and_cache import reshape_and_cache

    fmax = torch.finfo(cache_dtype).max
    key = torch.randn(64, 8, 128, device=DEVICE) * (fmax / 2)  # about a third beyond the largest value
    value = torch.randn(64, 8, 128, device=DEVICE).to(torch.bfloat16)
    slots = torch.randperm(128, device=DEVICE)[:64]
    ref = torch.zeros(2, 8, 16, 8, 128, dtype=cache_dtype, device=DEVICE)
    got = ref.clone()
    write_kv_cache(key, value, ref, slots)
    reshape_and_cache(key, value, got[0], got[1], slots)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    assert got[0].float().abs().max() == fmax and not got.float().isnan().any()


def test_heuristic_splits_few_decodes_on_this_gpu():
    from pagedllm.kernels.attention.launch_config import choose_num_splits

    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    assert choose_num_splits(2, 1, 16384, 8, sms) > 1
    assert choose_num_splits(256, 1, 4096, 8, sms) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_prefill(dtype):
    _compare([(0, 2048), (512, 1024)], 32, 8, 128, 16, dtype, seed=3)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size,window,soft_cap",
    [
        (16, 16, 64, 32, None, None),  # MHA, small heads, large blocks
        (16, 8, 256, 16, 1024, 50.0),  # Gemma-2-like: D=256, window, soft cap
        (24, 8, 96, 32, None, None),  # non-power-of-two head size and group (3)
        (64, 8, 128, 16, 700, None),  # group of 8 with a window shorter than the contexts
    ],
)
def test_head_configs(num_heads, num_kv_heads, head_size, block_size, window, soft_cap):
    reqs = _mixed_reqs(4, 12, 2500, [(0, 300), (1500, 200)])
    _compare(reqs, num_heads, num_kv_heads, head_size, block_size, torch.bfloat16, window=window,
             soft_cap=soft_cap, seed=num_heads + head_size)
    # The same heads on a split pure-decode batch.
    _compare([(3000, 1), (1800, 1)], num_heads, num_kv_heads, head_size, block_size, torch.float16,
             window=window, soft_cap=soft_cap, num_splits=8, seed=5)


def test_fp32_is_exact_enough():
    # fp32 must not go through TF32 tensor cores.
    reqs = _mixed_reqs(6, 8, 1200, [(100, 77)])
    from pagedllm.attention.backends.torch_ref import TorchRefImpl
    from pagedllm.attention.backends.triton import TritonImpl

    query, key, value, kv_cache, md = _build(reqs, 8, 2, 128, 16, torch.float32, seed=6)
    ref_cache = kv_cache.clone()
    expected = TorchRefImpl(8, 128, 128**-0.5, 2).forward(query, key, value, ref_cache, md)
    out = TritonImpl(8, 128, 128**-0.5, 2).forward(query, key, value, kv_cache, md)
    torch.testing.assert_close(out, expected, atol=2e-4, rtol=2e-4)


def test_cuda_graph_replay():
    # The launch path must not sync with the device, or capture fails; replays must track new inputs.
    from pagedllm.attention.backends.torch_ref import TorchRefImpl
    from pagedllm.attention.backends.triton import TritonImpl

    reqs = [(700, 1), (90, 1), (2000, 1), (5, 1)]
    query, key, value, kv_cache, md = _build(reqs, 32, 8, 128, 16, torch.bfloat16, seed=8, pad=4)
    impl = TritonImpl(32, 128, 128**-0.5, 8)
    ref_cache = kv_cache.clone()
    impl.forward(query, key, value, kv_cache.clone(), md)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = impl.forward(query, key, value, kv_cache, md)
    query.copy_(torch.randn_like(query))
    graph.replay()
    torch.cuda.synchronize()
    expected = TorchRefImpl(32, 128, 128**-0.5, 8).forward(query, key, value, ref_cache, md)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_decode_pieces_on_a_ragged_batch(cache_dtype):
    # Contexts cut into even pieces (decode_pieces.py) on a batch big enough for the engine to choose them:
    # torch_ref's outputs and cache bytes; the same bits whatever the request order and across replays of
    # one CUDA graph; every counter back at zero.
    from pagedllm.attention.backends.torch_ref import TorchRefImpl
    from pagedllm.attention.backends.triton import TritonImpl
    from pagedllm.kernels.attention import decode_pieces

    gen = torch.Generator().manual_seed(3)
    reqs = [(int(c), 1) for c in torch.randint(1, 5000, (150,), generator=gen)] + [(9000, 1), (0, 1)]
    query, key, value, kv_cache, md = _build(reqs, 16, 8, 128, 16, torch.bfloat16, seed=21, cache_dtype=cache_dtype)
    ref_cache = kv_cache.clone()
    expected = TorchRefImpl(16, 128, 128**-0.5, 8).forward(query, key, value, ref_cache, md)
    impl = TritonImpl(16, 128, 128**-0.5, 8)
    assert impl._uses_pieces(md, query, kv_cache[0])
    cache = kv_cache.clone()
    out = impl.forward(query, key, value, cache, md)
    torch.cuda.synchronize()
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)

    md.decode_order = torch.argsort(-md.seq_lens.long(), stable=True).to(torch.int32)
    md.step_cache.clear()
    graph = torch.cuda.CUDAGraph()
    cache2 = kv_cache.clone()
    impl.forward(query, key, value, cache2, md)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        replayed = impl.forward(query, key, value, cache2, md)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out)
    ws = decode_pieces._workspaces[query.device]
    assert not ws.grab.any() and not ws.done.any() and not ws.arrive.any()


def test_decode_loads_before_its_wait_only_what_the_qk_norm_launch_leaves_alone():
    # Qwen3's decode layer: the q/k norm + rotary launch rewrites q and stores the new K/V, then decode
    # attention reads the cache. Under PDL, attention reads lengths and asks L2 for its first tile before
    # waiting: replays of one graph of both launches, with new queries and keys each time, give
    # torch_ref's values and cache every time.
    from pagedllm.attention.backends.torch_ref import TorchRefImpl
    from pagedllm.attention.backends.triton import TritonImpl
    from pagedllm.kernels import qk_norm_rotary
    from pagedllm.layers.attention import qk_transform
    from pagedllm.layers.norm import RMSNorm
    from pagedllm.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(5)
    reqs = [(int(c), 1) for c in torch.randint(1, 3000, (200,), generator=gen)] + [(70, 1)]
    query, key, value, kv_cache, md = _build(reqs, 16, 8, 128, 16, torch.bfloat16, seed=31)
    md.decode_order = torch.argsort(-md.seq_lens.long(), stable=True).to(torch.int32)
    positions = (md.seq_lens - 1).long()
    norm_q, norm_k = RMSNorm(128, params_dtype=torch.bfloat16).cuda(), RMSNorm(128, params_dtype=torch.bfloat16).cuda()
    norm_q.weight.normal_(1.0, 0.1, generator=torch.Generator(device=DEVICE).manual_seed(1))
    rope = RotaryEmbedding(128, 1.0 / (1e6 ** (torch.arange(0, 128, 2, device=DEVICE, dtype=torch.float32) / 128)))
    q_in, k_in = query.clone(), key.clone()
    qk = qk_transform(rope, norm_q, norm_k, 128)

    def layer(impl, cache):
        # The backend's choice for these modules: the q/k norm + rotary launch stores the K/V.
        q, k = query.copy_(q_in), key.copy_(k_in)
        return impl.forward_qk(positions, q, k, value, cache, md, qk)

    impl = TritonImpl(16, 128, 128**-0.5, 8)
    cache = kv_cache.clone()
    layer(impl, cache)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(impl, cache)
    for i in range(3):
        q_in.copy_(torch.randn(q_in.shape, generator=torch.Generator(device=DEVICE).manual_seed(i), device=DEVICE))
        k_in.copy_(torch.randn(k_in.shape, generator=torch.Generator(device=DEVICE).manual_seed(9 + i), device=DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        q, k = q_in.clone(), k_in.clone()
        qk_norm_rotary.qk_norm_rotary_(positions, q, k, norm_q.weight, norm_k.weight, norm_q.eps, norm_k.eps,
                                       rope.inv_freq, 128)
        ref_cache = kv_cache.clone()
        expected = TorchRefImpl(16, 128, 128**-0.5, 8).forward(q, k, value, ref_cache, md)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(cache, ref_cache)
