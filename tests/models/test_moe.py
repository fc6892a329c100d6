"""Mixture-of-experts: the router, the per-expert reference and the experts' loading, and end-to-end greedy
parity with HF transformers when every token is routed to the same experts (the others get none)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.layers.fused_moe import MoEExperts, fused_experts_ref, select_experts


def _expert_mlp(x, w13, w2):  # one token through one expert, written out: [H] -> [H]
    i = w2.shape[1]
    gate, up = w13[:i] @ x, w13[i:] @ x
    return w2 @ (gate * torch.sigmoid(gate) * up)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_select_experts(top_k, renormalize):
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(9, 8, generator=g)
    weights, ids = select_experts(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (9, top_k)
    for t in range(9):
        probs = torch.exp(logits[t].double()) / torch.exp(logits[t].double()).sum()
        best = sorted(range(8), key=lambda e: -probs[e].item())[:top_k]
        assert ids[t].tolist() == best
        want = probs[best] / (probs[best].sum() if renormalize else 1.0)
        torch.testing.assert_close(weights[t].double(), want, rtol=1e-6, atol=1e-7)


def test_select_experts_bad_top_k():
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, 4\].*got 5"):
        select_experts(torch.zeros(2, 4), 5, True)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_reference_sums_each_tokens_experts(top_k):
    """Expert 3 is chosen by no token: it must contribute nothing, and the rest exactly their share."""
    g = torch.Generator().manual_seed(7)
    t, h, i, e = 11, 16, 8, 6
    x = torch.randn(t, h, generator=g, dtype=torch.float64)
    w13 = torch.randn(e, 2 * i, h, generator=g, dtype=torch.float64)
    w2 = torch.randn(e, h, i, generator=g, dtype=torch.float64)
    w13[3] = float("nan")  # read by nobody
    allowed = torch.tensor([0, 1, 2, 4, 5])
    ids = torch.stack([allowed[torch.randperm(5, generator=g)[:top_k]] for _ in range(t)]).to(torch.int32)
    weights = torch.rand(t, top_k, generator=g)
    out = fused_experts_ref(x, w13, w2, weights, ids)
    for tok in range(t):
        want = sum(weights[tok, k].double() * _expert_mlp(x[tok], w13[ids[tok, k]], w2[ids[tok, k]])
                   for k in range(top_k))
        torch.testing.assert_close(out[tok], want)


def test_weight_loader_stacks_experts():
    e, h, i = 4, 8, 6
    moe = MoEExperts(e, 2, h, i, renormalize=True, params_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    gates = [torch.randn(i, h, generator=g) for _ in range(e)]
    ups = [torch.randn(i, h, generator=g) for _ in range(e)]
    downs = [torch.randn(h, i, generator=g) for _ in range(e)]
    for x in range(e):
        moe.weight_loader(moe.w13_weight, gates[x], "w1", x)
        moe.weight_loader(moe.w13_weight, ups[x], "w3", x)
        moe.weight_loader(moe.w2_weight, downs[x], "w2", x)
    assert torch.equal(moe.w13_weight[2], torch.cat([gates[2], ups[2]]))
    assert torch.equal(moe.w2_weight[1], downs[1])
    # A checkpoint that stacks every expert already: [E, 2I, H] and [E, H, I].
    stacked = MoEExperts(e, 2, h, i, renormalize=True, params_dtype=torch.float32)
    stacked.weight_loader(stacked.w13_weight, torch.stack([torch.cat([a, b]) for a, b in zip(gates, ups)]))
    stacked.weight_loader(stacked.w2_weight, torch.stack(downs))
    assert torch.equal(stacked.w13_weight, moe.w13_weight) and torch.equal(stacked.w2_weight, moe.w2_weight)


def test_weight_loader_errors():
    moe = MoEExperts(4, 2, 8, 6, renormalize=True, params_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"expert id must be in \[0, 4\); got 4"):
        moe.weight_loader(moe.w2_weight, torch.zeros(8, 6), "w2", 4)
    with pytest.raises(ValueError, match="shard id must be one of w1, w2, w3; got 'w4'"):
        moe.weight_loader(moe.w2_weight, torch.zeros(8, 6), "w4", 0)
    with pytest.raises(ValueError, match=r"expert 1 w1: parameter \(6, 8\), checkpoint \(5, 8\)"):
        moe.weight_loader(moe.w13_weight, torch.zeros(5, 8), "w1", 1)
    with pytest.raises(ValueError, match="has 3 experts; the model has 4"):
        moe.weight_loader(moe.w2_weight, torch.zeros(3, 8, 6))
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, 4\].*got 0"):
        MoEExperts(4, 0, 8, 6, renormalize=True)


# kind -> (router row per chosen expert: its scale), the others zero. Scales differ so the order is strict.
FORCED = {"mixtral": {5: 1.0, 2: 0.5}, "qwen2_moe": {6: 1.0}, "qwen3_moe": {e: 1.0 - 0.1 * n for n, e in
                                                                          enumerate([9, 0, 3, 15, 7, 4, 12, 1])}}
MAX_NEW = 8


def _force_routing(path: str, chosen: dict[int, float]) -> None:
    """Every token's hidden state gets a large positive coordinate 0, and the routers read only that
    coordinate, so every token of every step picks the experts of ``chosen`` in its order."""
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["model.embed_tokens.weight"][:, 0] = 1.0
    for name, t in tensors.items():
        if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            t.zero_()
            for e, scale in chosen.items():
                t[e, 0] = scale
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("kind", list(FORCED))
def test_every_token_picks_the_same_experts(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(kind, tmp_path / kind)
    _force_routing(path, FORCED[kind])
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 19, 33)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        expected.append((out.sequences[0, len(p):].tolist(), [torch.log_softmax(x[0], -1) for x in out.logits]))

    # A token budget of 16 cuts the prompts into chunks, so steps mix prefill chunks and decodes.
    llm = LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22,
              max_num_batched_tokens=16)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    routed: list[torch.Tensor] = []
    for layer in model.model.layers:
        if isinstance(getattr(layer.mlp, "experts", None), MoEExperts):
            moe = layer.mlp.experts
            layer.mlp.gate.register_forward_hook(
                lambda mod, args, logits, moe=moe: routed.append(select_experts(logits, moe.top_k, moe.renormalize)[1]))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    chosen = torch.tensor(list(FORCED[kind]), dtype=torch.int32)
    assert routed and all(torch.equal(ids, chosen.expand_as(ids)) for ids in routed)
    for out, (ids, lps) in zip(outs, expected):
        assert out.outputs[0].token_ids == ids
        for tok, d, ref in zip(ids, out.outputs[0].logprobs, lps):
            assert abs(d[tok].logprob - ref[tok].item()) < 1e-3


def test_checkpoint_missing_an_expert_is_refused(tmp_path):
    path = make_tiny_model("mixtral", tmp_path / "mixtral")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.block_sparse_moe.experts.6.w3.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 parameters of MixtralForCausalLM: model\.layers\.1\.mlp\.experts\.w13_weight"):
        LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22)
