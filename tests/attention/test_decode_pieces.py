"""Decode attention in even pieces (decode_pieces.py) against torch_ref and the one-pass kernel; interpreted on CPU."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not importable; the Triton backend cannot be tested")

from pagedllm.attention.backends import torch_ref  # noqa: E402
from pagedllm.attention.backends.triton import TritonBackend, TritonImpl  # noqa: E402
from pagedllm.kernels.attention import decode_pieces  # noqa: E402
from pagedllm.layers.attention import qk_transform  # noqa: E402
from pagedllm.layers.rotary import RotaryEmbedding  # noqa: E402
from paged_batches import build_paged_batch  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Contexts from empty to several pieces of the smallest base length (128 keys).
RAGGED = [(40, 1), (0, 1), (300, 1), (17, 1), (700, 1), (129, 1)]
# ... and one that 128-key pieces would cut into more than MAX_PIECES: it takes longer pieces.
RAGGED_LONG = RAGGED + [(decode_pieces.MAX_PIECES * 128 + 50, 1)]


def _impl(num_heads, head_size, num_kv_heads, soft_cap=None):
    """An impl that decodes in pieces over any cache and batch: the kernel's arithmetic does not depend on
    the cache's dtype, and the engine's rule for taking pieces is tested on its own below."""
    impl = TritonImpl(num_heads, head_size, head_size**-0.5, num_kv_heads, None, soft_cap)
    impl._uses_pieces = lambda md, query, k_cache: md.max_query_len == 1
    return impl


def _counters_at_zero(device) -> bool:
    ws = decode_pieces._workspaces[device]
    return not (ws.grab.any() or ws.done.any() or ws.arrive.any())


@pytest.mark.parametrize(
    "reqs,num_heads,num_kv_heads,head_size,dtype,soft_cap",
    [
        pytest.param(RAGGED, 8, 2, 64, torch.float32, None, id="gqa4-fp32"),
        pytest.param(RAGGED, 4, 4, 128, torch.float16, None, id="mha-d128-fp16"),
        pytest.param(RAGGED_LONG, 8, 1, 64, torch.float32, 20.0, id="gqa8-softcap-past-max-pieces"),
        pytest.param(RAGGED, 6, 2, 96, torch.float32, None, id="gqa3-d96"),
    ],
)
def test_pieces_match_torch_ref(reqs, num_heads, num_kv_heads, head_size, dtype, soft_cap):
    query, key, value, cache, poisoned, metadata = build_paged_batch(reqs, num_heads, num_kv_heads, head_size, 16,
                                                                     dtype, 5, device=DEVICE)
    md = metadata()
    expected = torch_ref.TorchRefImpl(num_heads, head_size, head_size**-0.5, num_kv_heads, None, soft_cap).forward(
        query, key, value, cache, md)
    impl = _impl(num_heads, head_size, num_kv_heads, soft_cap)
    out = impl.forward(query, key, value, poisoned, metadata())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tol)
    written = md.slot_mapping[md.slot_mapping >= 0]
    for kv in range(2):  # the new token's K/V, written by its request's last piece, where torch_ref put it
        flat_ref, flat_out = cache[kv].view(-1, num_kv_heads, head_size), poisoned[kv].view(-1, num_kv_heads, head_size)
        assert torch.equal(flat_out[written], flat_ref[written])
    assert _counters_at_zero(query.device)


def test_same_bits_in_any_order_and_over_stale_partials():
    # The last piece to arrive folds all of them in piece order: neither the request order nor what the
    # scratch held before may change a bit.
    query, key, value, cache, _, metadata = build_paged_batch(RAGGED, 8, 2, 64, 16, torch.float32, 7, device=DEVICE)
    impl = _impl(8, 64, 2)
    first = impl.forward(query, key, value, cache.clone(), metadata())
    md = metadata()
    md.decode_order = torch.argsort(-md.seq_lens.long(), stable=True).to(torch.int32)
    ws = decode_pieces._workspaces[query.device]
    ws.part_acc.fill_(float("nan"))
    ws.part_ml.fill_(float("nan"))
    again = impl.forward(query, key, value, cache.clone(), md)
    assert torch.equal(first, again)
    assert _counters_at_zero(query.device)


def test_padding_request_reads_nothing_and_writes_zeros():
    # A decode graph pads its batch with requests of length 0 and slot -1.
    query, key, value, cache, _, metadata = build_paged_batch([(50, 1), (9, 1), (200, 1)], 4, 2, 64, 16,
                                                              torch.float32, 9, device=DEVICE)
    md = metadata()
    md.seq_lens[1] = 0
    md.slot_mapping[1] = -1
    expected_cache = cache.clone()
    out = _impl(4, 64, 2).forward(query, key, value, cache, md)
    assert not out[1].any()
    ref_md = metadata()
    ref = TritonImpl(4, 64, 64**-0.5, 2)
    expected = ref.forward(query, key, value, expected_cache, ref_md)
    for row in (0, 2):
        torch.testing.assert_close(out[row], expected[row], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["fp16", "e4m3"])
def test_fused_rotary_matches_the_one_pass_kernel(cache_dtype):
    # What a Llama decode step hands over: q and k before their rotary embedding.
    query, key, value, cache, _, metadata = build_paged_batch(RAGGED, 4, 2, 64, 16, torch.float16, 13, device=DEVICE,
                                                              cache_dtype=cache_dtype, kv_on_cache_grid=True)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    rotary = RotaryEmbedding(64, inv_freq, 1.0).to(DEVICE)
    outs, caches = [], []
    for impl in (_impl(4, 64, 2), TritonImpl(4, 64, 64**-0.5, 2)):
        c = cache.clone()
        md = metadata()
        positions = md.seq_lens.long() - 1
        outs.append(impl.forward_qk(positions, query.clone(), key.clone(), value, c, md,
                                    qk_transform(rotary, None, None, 64)))
        caches.append(c)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=2e-3, rtol=2e-3)


def test_engine_rule_and_scratch_accounting():
    # Float8 decode of at least two (request, KV head) pairs an SM takes pieces; a 16-bit cache, a sliding
    # window or a prompt chunk does not. Only the float8 case reserves scratch at start.
    from pagedllm.kernels.attention.launch_config import device_sm_count

    sms = device_sm_count(DEVICE)
    n = 2 * sms // 2
    reqs = [(30, 1)] * n
    query, key, value, cache, _, metadata = build_paged_batch(reqs, 4, 2, 64, 16, torch.float16, 1, device=DEVICE,
                                                              cache_dtype=torch.float8_e4m3fn)
    impl = TritonImpl(4, 64, 0.125, 2)
    assert impl._uses_pieces(metadata(), query, cache[0])
    small = build_paged_batch(reqs[: n - 1], 4, 2, 64, 16, torch.float16, 1, device=DEVICE,
                              cache_dtype=torch.float8_e4m3fn)
    assert not impl._uses_pieces(small[5](), small[0], small[3][0])
    assert not impl._uses_pieces(metadata(), query, cache[0].to(torch.float16))
    assert not TritonImpl(4, 64, 0.125, 2, 16)._uses_pieces(metadata(), query, cache[0])
    chunk = build_paged_batch([(30, 5)] * n, 4, 2, 64, 16, torch.float16, 1, device=DEVICE,
                              cache_dtype=torch.float8_e4m3fn)
    assert not impl._uses_pieces(chunk[5](), chunk[0], chunk[3][0])
    assert TritonBackend.workspace_bytes(257, 16, 8, 128, 1) == decode_pieces.workspace_bytes(257, 16, 8, 128) > 0
    assert TritonBackend.workspace_bytes(257, 16, 8, 128, 2) == 0
    # Reserved at start for the largest batch, the workspace serves every smaller launch as it is.
    TritonBackend.reserve_workspace(query.device, n + 1, 4, 2, 64, 1)
    reserved = decode_pieces._workspaces[query.device]
    impl.forward(query, key, value, cache, metadata())
    assert decode_pieces._workspaces[query.device] is reserved
