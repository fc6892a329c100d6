"""Layer checks: tensor-parallel sharding of the weight loaders; op-for-op parity of norms, activations, rotary."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers.activation import GeluAndMul, SiluAndMul
from pagedllm.layers.embedding import ParallelLMHead, VocabEmbedding
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_qkv_shards_per_rank(tp_size):
    torch.manual_seed(0)
    hidden, d, hq, hkv = 8, 2, 4, 2
    q, k, v = torch.randn(hq * d, hidden), torch.randn(hkv * d, hidden), torch.randn(hkv * d, hidden)
    fused = torch.cat([q, k, v])
    for rank in range(tp_size):
        for fused_ckpt in (False, True):
            layer = QKVParallelLinear(hidden, d, hq, hkv, bias=False, tp_rank=rank, tp_size=tp_size)
            if fused_ckpt:
                layer.weight_loader(layer.weight, fused)
            else:
                for sid, w in zip("qkv", (q, k, v)):
                    layer.weight_loader(layer.weight, w, sid)
            got_q, got_k, got_v = layer.weight.split([layer.q_size, layer.kv_size, layer.kv_size])
            kv_rank = rank // layer.num_kv_head_replicas
            torch.testing.assert_close(got_q, q.chunk(tp_size)[rank], rtol=0, atol=0)
            torch.testing.assert_close(got_k, k.chunk(hkv // layer.num_kv_heads)[kv_rank], rtol=0, atol=0)
            torch.testing.assert_close(got_v, v.chunk(hkv // layer.num_kv_heads)[kv_rank], rtol=0, atol=0)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_merged_and_row_shards_recombine(tp_size):
    torch.manual_seed(0)
    gate, up, down = torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6)
    x = torch.randn(3, 4)
    ref = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    out = torch.zeros_like(ref)
    for rank in range(tp_size):
        gu = MergedColumnParallelLinear(4, [6, 6], bias=False, tp_rank=rank, tp_size=tp_size)
        gu.weight_loader(gu.weight, torch.cat([gate, up]))  # fused checkpoint (Phi-3)
        dn = RowParallelLinear(6, 4, bias=False, tp_rank=rank, tp_size=tp_size)
        dn.weight_loader(dn.weight, down)
        out += SiluAndMul()(gu(x)) @ dn.weight.T  # the all-reduce, by hand
    torch.testing.assert_close(out, ref)


def test_vocab_shards_pad_the_last_one():
    w = torch.randn(10, 3)
    shards = []
    for rank in range(3):
        emb = VocabEmbedding(10, 3, tp_rank=rank, tp_size=3)
        emb.weight_loader(emb.weight, w)
        shards.append(emb.weight.data)
    full = torch.cat(shards)
    assert torch.equal(full[:10], w) and torch.equal(full[10:], torch.zeros(2, 3))
    head = ParallelLMHead(10, 3)
    head.weight_loader(head.weight, w)
    h = torch.randn(2, 3)
    torch.testing.assert_close(head.compute_logits(h), h @ w.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_hf(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x, res, w = torch.randn(5, 32, dtype=dtype), torch.randn(5, 32, dtype=dtype), torch.randn(32)
    pairs = [
        (RMSNorm(32, 1e-6, dtype), LlamaRMSNorm(32, 1e-6)),
        (GemmaRMSNorm(32, 1e-6, dtype), Gemma3RMSNorm(32, 1e-6)),
    ]
    for ours, theirs in pairs:
        ours.weight.data.copy_(w)
        theirs = theirs.to(dtype)
        theirs.weight.data.copy_(w)
        assert torch.equal(ours(x), theirs(x))
        out, new_res = ours(x, res)
        assert torch.equal(new_res, x + res) and torch.equal(out, theirs(res + x))


def test_activations_match_hf():
    from transformers.activations import ACT2FN

    x = torch.randn(4, 16)
    gate, up = x.chunk(2, -1)
    assert torch.equal(GeluAndMul("tanh")(x), ACT2FN["gelu_pytorch_tanh"](gate) * up)
    assert torch.equal(SiluAndMul()(x), ACT2FN["silu"](gate) * up)


def test_partial_rotary_matches_hf():
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    torch.manual_seed(0)
    head, rot = 16, 8
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
    rope = RotaryEmbedding(head, inv_freq, attention_scaling=1.25)
    pos = torch.tensor([0, 3, 7, 100])
    q, k = torch.randn(4, 4, head), torch.randn(4, 2, head)
    freqs = pos[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos() * 1.25, emb.sin() * 1.25
    # HF layout: [batch, heads, seq, dim] with cos [batch, seq, dim].
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    gq, gk = rope(pos, q.flatten(1), k.flatten(1))
    assert torch.equal(gq, hq[0].transpose(0, 1).flatten(1)) and torch.equal(gk, hk[0].transpose(0, 1).flatten(1))
