"""torch_ref (the kernels' oracle) checked against naive dense causal attention over shuffled block tables."""
from __future__ import annotations

import pytest
import torch
from paged_batches import build_paged_batch, sequence_slots

from pagedllm.attention.backends.torch_ref import TorchRefImpl


def _build(reqs, num_heads, num_kv_heads, head_size, block_size, dtype, seed, pad=0):
    """A paged batch (``reqs``: cached context, new tokens per request) plus the dense per-request K/V
    it encodes: the cached prefix read from the cache's slots, then the new keys and values."""
    query, key, value, kv_cache, _, metadata = build_paged_batch(
        reqs, num_heads, num_kv_heads, head_size, block_size, dtype, seed, pad
    )
    md = metadata()
    qsl = md.query_start_loc_cpu
    dense_k, dense_v = [], []
    for i, (ctx, _) in enumerate(reqs):
        cached = sequence_slots(md, i, block_size)[:ctx]
        dense_k.append(torch.cat([kv_cache[0].view(-1, num_kv_heads, head_size)[cached], key[qsl[i] : qsl[i + 1]]]))
        dense_v.append(torch.cat([kv_cache[1].view(-1, num_kv_heads, head_size)[cached], value[qsl[i] : qsl[i + 1]]]))
    return query, key, value, kv_cache, md, dense_k, dense_v


def _dense_attention(q, k, v, scale, window, soft_cap):
    """Per-head loops in float64 over the whole sequence; q holds the last q.shape[0] positions."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q_len, num_heads, q.shape[-1], dtype=torch.float64)
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        scores = q[:, h].double() @ kh.T * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ vh
    return out


CASES = [
    # reqs, Hq, Hkv, D, block_size, window, soft_cap, dtype
    pytest.param([(0, 9), (0, 3)], 4, 4, 16, 16, None, None, torch.float32, id="prefill-mha"),
    pytest.param([(37, 6), (16, 16), (0, 1)], 8, 2, 32, 16, None, None, torch.float32, id="prefix-gqa4"),
    pytest.param([(5, 1), (70, 1), (33, 1)], 8, 1, 16, 32, None, None, torch.float32, id="decode-mqa"),
    pytest.param([(0, 11), (40, 1), (19, 5), (3, 1)], 4, 2, 16, 16, 6, None, torch.float32, id="mixed-window"),
    pytest.param([(21, 4), (50, 1)], 4, 1, 24, 32, None, 5.0, torch.float32, id="mixed-softcap"),
    pytest.param([(17, 3), (30, 1), (0, 7)], 4, 2, 32, 16, 9, 20.0, torch.float16, id="fp16-all"),
]


@pytest.mark.parametrize("reqs,num_heads,num_kv_heads,head_size,block_size,window,soft_cap,dtype", CASES)
def test_torch_ref_matches_dense(reqs, num_heads, num_kv_heads, head_size, block_size, window, soft_cap, dtype):
    query, key, value, kv_cache, md, dense_k, dense_v = _build(
        reqs, num_heads, num_kv_heads, head_size, block_size, dtype, seed=len(reqs) * 101 + head_size, pad=2
    )
    scale = head_size**-0.5
    impl = TorchRefImpl(num_heads, head_size, scale, num_kv_heads, window, soft_cap)
    out = impl.forward(query, key, value, kv_cache, md)

    tol = 1e-5 if dtype == torch.float32 else 2e-3
    qsl = md.query_start_loc_cpu
    for i in range(md.num_reqs):
        expected = _dense_attention(query[qsl[i] : qsl[i + 1]], dense_k[i], dense_v[i], scale, window, soft_cap)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]].double(), expected, atol=tol, rtol=tol)
        # The paged cache now holds the request's whole sequence, in block-table order.
        slot = sequence_slots(md, i, block_size)
        assert torch.equal(kv_cache[0].view(-1, num_kv_heads, head_size)[slot], dense_k[i])
        assert torch.equal(kv_cache[1].view(-1, num_kv_heads, head_size)[slot], dense_v[i])
    assert torch.count_nonzero(out[md.num_actual_tokens :]) == 0, "padding rows must stay zero"


def test_torch_ref_many_decodes_cross_groups():
    # More decodes than the reference's batching group, with very different lengths in one group.
    reqs = [(1 + (7 * i) % 45, 1) for i in range(70)]
    query, key, value, kv_cache, md, dense_k, dense_v = _build(reqs, 2, 1, 8, 16, torch.float32, seed=7)
    impl = TorchRefImpl(2, 8, 0.3, 1)
    out = impl.forward(query, key, value, kv_cache, md)
    for i in range(md.num_reqs):
        expected = _dense_attention(query[i : i + 1], dense_k[i], dense_v[i], 0.3, None, None)
        torch.testing.assert_close(out[i : i + 1].double(), expected, atol=1e-5, rtol=1e-5)
