"""Triton attention kernels against the torch_ref oracle; on CPU they run in Triton's interpreter."""
from __future__ import annotations

import dataclasses

import pytest
import torch

_ON_GPU = torch.cuda.is_available()  # without a GPU, conftest.py runs the kernels interpreted

triton = pytest.importorskip("triton", reason="triton is not importable; the Triton backend cannot be tested")

from pagedllm.attention.backends import torch_ref  # noqa: E402
from pagedllm.kernels.attention import attend_tile as at_mod  # noqa: E402
from pagedllm.kernels.attention import launch_config as lc  # noqa: E402
from pagedllm.kernels.attention import paged_attention as pa_mod  # noqa: E402
from pagedllm.kernels.attention import reshape_and_cache as rc_mod  # noqa: E402
from pagedllm.kernels import rotary as rot_k  # noqa: E402
from pagedllm.kernels.attention.fused_inputs import ChunkKV, Rope  # noqa: E402
from pagedllm.layers.attention import qk_transform  # noqa: E402
from pagedllm.layers.rotary import RotaryEmbedding  # noqa: E402
from pagedllm.attention.backends import triton as _BACKEND  # noqa: E402
from paged_batches import build_paged_batch  # noqa: E402


# The interpreter itself trips a NumPy deprecation on every scalar index; it says nothing about our code.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

DEVICE = torch.device("cuda" if _ON_GPU else "cpu")


def _tol(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


def _check(reqs, num_heads, num_kv_heads, head_size, block_size, dtype, *, window=None, soft_cap=None,
           num_splits=1, pad=0, seed=0, max_seq_len_bound=None):
    query, key, value, kv_cache, poisoned, metadata = build_paged_batch(
        reqs, num_heads, num_kv_heads, head_size, block_size, dtype, seed, pad, device=DEVICE
    )
    md = metadata()
    if max_seq_len_bound is not None:
        # What a captured decode graph launches with: a bound, not the batch's own longest context.
        md = dataclasses.replace(md, max_seq_len=max_seq_len_bound)
    scale = head_size**-0.5
    ref = torch_ref.TorchRefImpl(num_heads, head_size, scale, num_kv_heads, window, soft_cap)
    expected = ref.forward(query, key, value, kv_cache, md)
    impl = _BACKEND.TritonImpl(num_heads, head_size, scale, num_kv_heads, window, soft_cap)
    impl.num_splits = num_splits
    out = impl.forward(query, key, value, poisoned, md)

    torch.testing.assert_close(out.float(), expected.float(), **_tol(dtype))
    # The Triton cache write must land exactly where the reference's did.
    written = md.slot_mapping[md.slot_mapping >= 0]
    for kv in range(2):
        flat_ref = kv_cache[kv].view(-1, num_kv_heads, head_size)
        flat_out = poisoned[kv].view(-1, num_kv_heads, head_size)
        assert torch.equal(flat_out[written], flat_ref[written])


# Each case covers a different corner; together they span every axis without the full product.
@pytest.mark.parametrize(
    "reqs,num_heads,num_kv_heads,head_size,block_size,dtype,window,soft_cap,num_splits,pad",
    [
        pytest.param([(0, 19), (0, 5)], 4, 1, 64, 16, torch.float32, None, None, 1, 0, id="prefill-noprefix-gqa4"),
        pytest.param([(37, 12), (16, 20)], 2, 2, 128, 32, torch.float16, None, None, 1, 0, id="prefill-prefix-mha"),
        pytest.param([(40, 1), (0, 1), (95, 1), (17, 1)], 8, 1, 64, 16, torch.float16, None, None, 1, 0,
                     id="decode-gqa8"),
        pytest.param([(0, 7), (50, 1), (20, 13), (9, 1), (64, 1)], 8, 2, 256, 16, torch.float32, None, None, 1, 3,
                     id="mixed-d256-pad"),
        pytest.param([(30, 9), (45, 1), (0, 14)], 4, 2, 64, 32, torch.float16, 10, None, 1, 0, id="window"),
        pytest.param([(25, 6), (33, 1)], 6, 2, 96, 16, torch.float32, None, 15.0, 1, 0, id="softcap-d96-gqa3"),
        pytest.param([(150, 1), (70, 1), (3, 1)], 8, 2, 128, 16, torch.float16, None, None, 4, 0, id="split-decode"),
        pytest.param([(90, 1), (60, 11), (0, 3)], 8, 1, 64, 32, torch.float32, 20, 10.0, 3, 2,
                     id="split-mixed-window-softcap"),
        pytest.param([(3, 1), (0, 1)], 2, 2, 80, 16, torch.float32, None, None, 5, 0, id="split-short-empty-parts"),
        pytest.param([(31, 1), (47, 1), (0, 1)], 4, 4, 64, 16, torch.float32, 16, None, 1, 2,
                     id="decode-window-pad"),
        pytest.param([(15, 1), (160, 1)], 4, 2, 64, 16, torch.float32, None, None, 3, 1, id="split-decode-pad"),
        # Chunks longer than a 64-key tile after a prefix: cached tiles, one straddling, then chunk tiles.
        pytest.param([(70, 150), (0, 130), (5, 1)], 4, 2, 64, 16, torch.float32, None, None, 1, 2,
                     id="long-chunks-after-prefix"),
        pytest.param([(100, 90), (0, 70)], 4, 1, 64, 16, torch.float16, 48, None, 1, 0, id="long-chunks-window"),
    ],
)
def test_triton_matches_torch_ref(reqs, num_heads, num_kv_heads, head_size, block_size, dtype, window, soft_cap,
                                  num_splits, pad):
    _check(reqs, num_heads, num_kv_heads, head_size, block_size, dtype, window=window, soft_cap=soft_cap,
           num_splits=num_splits, pad=pad, seed=len(reqs) + head_size)


def test_many_requests_cross_search_block():
    # More requests than one step of the kernel's request lookup scans.
    n = pa_mod._SEARCH_BLOCK + 5
    reqs = [((3 * i) % 20, 1 + (i % 9 == 0) * 2) for i in range(n)]
    _check(reqs, 2, 1, 64, 16, torch.float32)


def test_heuristic_split_path_matches():
    # A lone long decode: the heuristic alone must choose to split, and stay exact.
    reqs = [(1100, 1)]
    assert lc.choose_num_splits(1, 1, 1101, 1, num_sms=64) > 1
    _check(reqs, 4, 1, 64, 16, torch.float16, num_splits=None)


@pytest.mark.parametrize("window", [None, 40])
def test_split_decode_under_a_length_bound(window):
    # Launch facts from a bound far above every context (as under CUDA graphs): each request's own
    # context is cut into the partitions, from one tile up, and short ones leave partitions empty.
    reqs = [(4, 1), (129, 1), (700, 1), (63, 1)]
    assert lc.choose_num_splits(len(reqs), 1, 4096, 2, num_sms=64) > 8
    _check(reqs, 4, 2, 64, 16, torch.float16, window=window, num_splits=None, max_seq_len_bound=4096, seed=9)


@pytest.mark.parametrize("num_splits", [1, 4])
# The deliberately wrong order below leaves partitions unwritten; reducing that garbage may overflow.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_decode_order_changes_nothing(num_splits):
    # Programs taking requests longest-first (the runner's decode_order) give the same bits and cache.
    reqs = [(33, 1), (0, 1), (70, 1), (16, 1), (5, 1)]
    query, key, value, kv_cache, _, metadata = build_paged_batch(reqs, 4, 2, 64, 16, torch.float32, 12, 0,
                                                                 device=DEVICE)
    md = metadata()
    order = torch.argsort(-md.seq_lens.long(), stable=True).to(torch.int32)
    assert order.tolist() != list(range(len(reqs)))
    outs = []
    for decode_order in (None, order):
        impl = _BACKEND.TritonImpl(4, 64, 0.125, 2, None, None)
        impl.num_splits = num_splits
        cache = kv_cache.clone()
        outs.append((impl.forward(query, key, value, cache, dataclasses.replace(md, decode_order=decode_order)), cache))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
    # The order is really followed: sending every program to request 0 leaves the others unserved.
    impl = _BACKEND.TritonImpl(4, 64, 0.125, 2, None, None)
    impl.num_splits = num_splits
    bad = impl.forward(query, key, value, kv_cache.clone(), dataclasses.replace(md, decode_order=torch.zeros_like(order)))
    assert torch.equal(bad[0], outs[0][0][0]) and not torch.equal(bad, outs[0][0])


def _through_cache(query, key, value, kv_cache, md, num_splits, window=None, chunk_kv=None):
    """The step's K/V written by reshape_and_cache, then one paged_attention launch reading every key
    through the block table (unless ``chunk_kv`` is given)."""
    cache = kv_cache.clone()
    rc_mod.reshape_and_cache(key, value, cache[0], cache[1], md.slot_mapping)
    out = pa_mod.paged_attention(
        query[: md.num_actual_tokens], cache[0], cache[1], md.block_table, md.seq_lens, md.query_start_loc,
        num_reqs=md.num_reqs, max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, scale=0.125,
        sliding_window=window, num_splits=num_splits, chunk_kv=chunk_kv,
    )
    return out, cache


@pytest.mark.parametrize("num_splits,window", [(1, None), (3, None), (1, 24)])
def test_chunk_keys_from_step_rows_or_cache_are_identical(num_splits, window):
    # Prompt tiles read the step's own keys from its key/value rows (by TMA, or by pointers under a
    # sliding window); through the cache they must give the same bits.
    # Two chunks of more than one 64-row tile, a decode and a short chunk (small: the interpreter is slow).
    reqs = [(70, 80), (0, 70), (20, 1), (3, 20)]
    query, key, value, kv_cache, _, metadata = build_paged_batch(reqs, 4, 2, 64, 16, torch.float16, 13, 1,
                                                                 device=DEVICE)
    descs = at_mod.chunk_descriptors(key, value, key.shape[0], 64, window is None)
    assert (descs[0] is not None) == (window is None)  # the interpreter emulates TMA, and an H200 has it
    impl = _BACKEND.TritonImpl(4, 64, 0.125, 2, window, None)
    impl.num_splits = num_splits
    from_step = impl.forward(query, key, value, kv_cache.clone(), metadata())
    md = metadata()
    through_cache, _ = _through_cache(query, key, value, kv_cache, md, num_splits, window)
    assert torch.equal(from_step[: md.num_actual_tokens], through_cache)
    # The rows are really read: different step keys (cache written from the originals) change the chunk rows only.
    moved, _ = _through_cache(query, key, value, kv_cache, md, num_splits, window, chunk_kv=ChunkKV(key + 1.0, value))
    n0, n1 = reqs[0][1], reqs[1][1]
    assert not torch.equal(moved[:n0], from_step[:n0]) and torch.equal(moved[n0 + n1], from_step[n0 + n1])


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_kv_write_fused_or_separate_is_identical(num_splits):
    # Pure decode stores the new K/V inside the attention launch; the separate write must agree bit for bit.
    reqs = [(33, 1), (0, 1), (70, 1), (16, 1)]
    query, key, value, kv_cache, _, metadata = build_paged_batch(reqs, 4, 2, 64, 16, torch.float32, 11, 1,
                                                                 device=DEVICE)
    impl = _BACKEND.TritonImpl(4, 64, 0.125, 2, None, None)
    impl.num_splits = num_splits
    cache = kv_cache.clone()
    fused = impl.forward(query, key, value, cache, metadata())
    md = metadata()
    separate, separate_cache = _through_cache(query, key, value, kv_cache, md, num_splits)
    assert torch.equal(fused[: md.num_actual_tokens], separate)
    assert torch.equal(cache, separate_cache)


@pytest.mark.parametrize("reqs", [[(33, 1), (0, 1), (70, 1), (16, 1)], [(20, 5), (0, 9), (3, 1)]],
                         ids=["decode", "mixed"])
def test_kv_written_by_caller_only_attends(reqs):
    # kv_written=True: this step's K/V are stored already (by the q/k norm + rotary launch), so the
    # launch must neither write the cache nor need key/value for the cache; same output as the
    # launch that writes them itself. Decode reads the new token from the cache; a prompt chunk may
    # still read its own keys from the step's rows, which hold the same values.
    query, key, value, kv_cache, _, metadata = build_paged_batch(reqs, 4, 2, 64, 16, torch.float32, 13, 1,
                                                                 device=DEVICE)
    impl = _BACKEND.TritonImpl(4, 64, 0.125, 2, None, None)
    written_cache = kv_cache.clone()
    expected = impl.forward(query, key, value, written_cache, metadata())
    cache = written_cache.clone()
    if all(q == 1 for _, q in reqs):
        key, value = torch.full_like(key, float("nan")), torch.full_like(value, float("nan"))
    out = impl.forward(query, key, value, cache, metadata(), kv_written=True)
    assert torch.equal(out, expected)
    assert torch.equal(cache, written_cache)
    with pytest.raises(ValueError, match="rotary"):
        impl.forward(query, key, value, cache, metadata(), kv_written=True, rope=Rope(torch.ones(32, device=DEVICE), 1.0))


@pytest.mark.parametrize(
    ("dtype", "rotary_dim", "scaling", "num_splits"),
    [(torch.float32, 64, 1.0, 1), (torch.float16, 32, 1.25, 4), (torch.float16, 64, 1.0, 1)],
)
def test_decode_rotary_in_attention_matches_rotary_kernel_first(dtype, rotary_dim, scaling, num_splits):
    # A decode step hands q and k over unrotated with the layer's RotaryEmbedding; the attention launch
    # rotates them in registers and must produce exactly what the rotary kernel followed by attention does,
    # outputs and cache alike (partial rotary and scaling included).
    reqs = [(33, 1), (0, 1), (70, 1), (16, 1), (130, 1)]
    query, key, value, kv_cache, _, metadata = build_paged_batch(reqs, 4, 2, 64, 16, dtype, 12, 1, device=DEVICE)
    md = metadata()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    rotary = RotaryEmbedding(64, inv_freq, scaling).to(DEVICE)
    impl = _BACKEND.TritonImpl(4, 64, 0.125, 2, None, None)
    impl.num_splits = num_splits

    n = len(reqs)
    positions = md.seq_lens.long() - 1
    q_ref, k_ref = query.clone(), key.clone()
    rot_k.rotary_neox_(positions, q_ref[:n], k_ref[:n], rotary.inv_freq, 64, scaling)
    cache_ref = kv_cache.clone()
    expected = impl.forward(q_ref, k_ref, value, cache_ref, metadata())

    cache = kv_cache.clone()
    q, k = query.clone(), key.clone()
    out = impl.forward_qk(positions, q, k, value, cache, metadata(), qk_transform(rotary, None, None, 64))
    assert torch.equal(out, expected)
    assert torch.equal(cache, cache_ref)
    # Rotated in the launch, not by the rotary kernel before it (which rotates in place).
    assert torch.equal(q, query) and torch.equal(k, key)


@pytest.mark.parametrize("pad", [0, 5])
def test_mixed_graph_padding_is_exact(pad):
    # What a mixed-batch CUDA graph launches: the batch padded to a token bucket, one padding request
    # owning the padding tokens (sequence length 0) and empty requests up to a fixed request count, with
    # bounds for the longest query run and context. Real rows must equal the unpadded launch bit for bit
    # (given the same longest-query bound, which fixes the tile), padding rows are zeros, and no cache
    # slot outside the real tokens' changes.
    reqs = [(12, 9), (30, 1), (0, 20)]
    t = sum(q for _, q in reqs)
    query, key, value, kv_cache, _, metadata = build_paged_batch(reqs, 8, 2, 64, 16, torch.float32, 21, pad,
                                                                 device=DEVICE)
    impl = _BACKEND.TritonImpl(8, 64, 0.125, 2, None, None)
    eager_md = dataclasses.replace(metadata(), max_query_len=64)
    eager_cache = kv_cache.clone()
    eager = impl.forward(query[:t], key[:t], value[:t], eager_cache, eager_md)

    extra = 4  # the padding request plus three empty ones
    md = metadata()
    qsl = md.query_start_loc_cpu + [t + pad] * extra
    width = md.block_table.shape[1]
    graph_md = dataclasses.replace(
        md,
        num_actual_tokens=t + pad,
        num_reqs=len(reqs) + extra,
        max_query_len=max(t + pad, 64),
        max_seq_len=4096,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.cat([md.seq_lens, torch.zeros(extra, dtype=torch.int32, device=DEVICE)]),
        block_table=torch.cat([md.block_table, torch.zeros(extra, width, dtype=torch.int32, device=DEVICE)]),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=md.seq_lens_cpu + [0] * extra,
    )
    graph_cache = kv_cache.clone()
    padded = impl.forward(query, key, value, graph_cache, graph_md)
    assert torch.equal(padded[:t], eager)
    assert torch.equal(padded[t:], torch.zeros_like(padded[t:]))
    assert torch.equal(graph_cache, eager_cache)


def test_rotary_outside_pure_decode_runs_the_module():
    # A mixed step: the rotary embedding is the module's (the attention launch rotates decode batches only).
    reqs = [(10, 3), (5, 1)]
    query, key, value, kv_cache, _, metadata = build_paged_batch(reqs, 4, 2, 64, 16, torch.float32, 1, device=DEVICE)
    rotary = RotaryEmbedding(64, 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))).to(DEVICE)
    positions = torch.cat([torch.arange(c, c + q) for c, q in reqs]).to(DEVICE)
    impl = _BACKEND.TritonImpl(4, 64, 0.125, 2, None, None)
    cache_ref = kv_cache.clone()
    expected = impl.forward(*rotary(positions, query.clone(), key.clone()), value, cache_ref, metadata())
    cache = kv_cache.clone()
    out = impl.forward_qk(positions, query.clone(), key.clone(), value, cache, metadata(),
                          qk_transform(rotary, None, None, 64))
    assert torch.equal(out, expected)
    assert torch.equal(cache, cache_ref)


def test_choose_num_splits():
    kw = dict(num_sms=132)
    assert lc.choose_num_splits(4, 1, 32768, 8, **kw) > 1  # few long decodes: split
    assert lc.choose_num_splits(256, 1, 4096, 8, **kw) == 1  # GPU already full
    assert lc.choose_num_splits(2, 1, 100, 8, **kw) == 1  # too short to be worth a reduction
    assert lc.choose_num_splits(2, 512, 32768, 8, **kw) == 1  # prefill in the batch
    assert lc.choose_num_splits(1, 1, 10**6, 1, **kw) <= lc._MAX_SPLITS


def test_reshape_and_cache_padding_and_cast():
    gen = torch.Generator().manual_seed(3)
    num_kv_heads, head_size, block_size, num_blocks = 3, 80, 16, 6
    key = torch.randn(7, num_kv_heads, head_size, generator=gen).to(DEVICE)
    value = torch.randn(7, num_kv_heads, head_size, generator=gen).to(DEVICE)
    slots = torch.tensor([5, 17, -1, 95, 40, -1, 0], dtype=torch.long, device=DEVICE)
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=torch.float16, device=DEVICE)
    expected = cache.clone()
    torch_ref.write_kv_cache(key, value, expected, slots)
    rc_mod.reshape_and_cache(key, value, cache[0], cache[1], slots)
    assert torch.equal(cache, expected)


def test_default_config_choices():
    # Decode: 64-key tiles whatever the context (a graph captured at the longest context launches the
    # same as an eager step), 4 warps for many programs, 2 for fewer; wide heads take 32-key tiles.
    dc = lc.default_config
    full = dc(128, 4, 1, max_seq_len=4096, num_reqs=256, num_kv_heads=8, num_sms=132)
    assert (full.tile_n, full.num_warps) == (64, 4)
    assert dc(128, 4, 1, max_seq_len=128, num_reqs=256, num_kv_heads=8, num_sms=132) == full
    assert dc(128, 2, 1, max_seq_len=1024, num_reqs=64, num_kv_heads=8, num_sms=132).num_warps == 2
    assert dc(256, 2, 1, max_seq_len=1024, num_reqs=64, num_kv_heads=8, num_sms=132).tile_n == 32
    assert dc(128, 4, 1, max_seq_len=32768, num_reqs=1, num_kv_heads=8, num_sms=132, split=True).num_warps == 4
    assert dc(128, 32, 1).block_m == 32  # a group wider than 16 heads still fits one program
    prefill = dc(256, 3, 700)
    assert prefill.block_m % 4 == 0 and prefill.block_m <= 64
    # A float8 cache: one warp and 32-key tiles for many decode programs; fewer programs, split
    # contexts, prompts and wide heads as with 16-bit caches.
    one_warp = (32, 1)
    c = dc(128, 4, 1, num_reqs=256, num_kv_heads=8, num_sms=132, cache_bytes=1)
    assert (c.tile_n, c.num_warps) == one_warp
    c = dc(128, 2, 1, num_reqs=99, num_kv_heads=8, num_sms=132, cache_bytes=1)
    assert (c.tile_n, c.num_warps) == one_warp
    c = dc(128, 4, 1, num_reqs=1, num_kv_heads=8, num_sms=132, split=True, cache_bytes=1)
    assert c == dc(128, 4, 1, num_reqs=1, num_kv_heads=8, num_sms=132, split=True)
    c = dc(128, 2, 1, num_reqs=64, num_kv_heads=8, num_sms=132, cache_bytes=1)
    assert (c.tile_n, c.num_warps) == (64, 2)
    assert dc(256, 2, 1, num_reqs=256, num_kv_heads=8, num_sms=132, cache_bytes=1).tile_n == 32
    assert dc(256, 3, 700, cache_bytes=1) == dc(256, 3, 700)
    assert full.max_regs is None


@pytest.mark.parametrize(
    "cfg",
    [
        lc.KernelConfig(block_m=16, tile_n=128, num_warps=4, num_stages=2),
        lc.KernelConfig(block_m=16, tile_n=32, num_warps=4, num_stages=2),
        lc.KernelConfig(block_m=64, tile_n=16, num_warps=4, num_stages=2),
        lc.KernelConfig(block_m=16, tile_n=32, num_warps=1, num_stages=2),  # float8 decode with many programs
    ],
    ids=lambda c: f"m{c.block_m}-n{c.tile_n}",
)
def test_explicit_tile_configs(cfg):
    # Tile shapes the defaults pick on GPUs for long contexts, exercised on a mixed ragged batch.
    reqs = [(300, 1), (0, 9), (130, 5), (7, 1)]
    num_heads, num_kv_heads, head_size, block_size = 8, 2, 64, 16
    query, key, value, kv_cache, poisoned, metadata = build_paged_batch(
        reqs, num_heads, num_kv_heads, head_size, block_size, torch.float32, seed=11, device=DEVICE
    )
    md = metadata()
    ref = torch_ref.TorchRefImpl(num_heads, head_size, 0.125, num_kv_heads)
    expected = ref.forward(query, key, value, kv_cache, md)
    rc_mod.reshape_and_cache(key, value, poisoned[0], poisoned[1], md.slot_mapping)
    out = pa_mod.paged_attention(
        query, poisoned[0], poisoned[1], md.block_table, md.seq_lens, md.query_start_loc,
        num_reqs=md.num_reqs, max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
        scale=0.125, config=cfg, num_splits=1,
    )
    torch.testing.assert_close(out, expected, **_tol(torch.float32))
