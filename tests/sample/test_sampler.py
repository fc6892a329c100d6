"""Tests for the batched sampler: greedy, seeded determinism, distributions, truncation and processing."""
from __future__ import annotations

import math

import pytest
import torch

from pagedllm.sample import Sampler, build_sampling_metadata
from pagedllm.sampling_params import SamplingParams

CPU = torch.device("cpu")


def run(params, logits, outputs=None, prompts=None, seeds=None):
    """Samples one step; returns (token ids [B] list, SamplerOutput)."""
    B, V = logits.shape
    outputs = outputs if outputs is not None else [[] for _ in range(B)]
    prompts = prompts if prompts is not None else [[0] for _ in range(B)]
    seeds = seeds if seeds is not None else list(range(B))
    md = build_sampling_metadata(params, prompts, outputs, seeds, V, CPU)
    out = Sampler()(logits, md)
    return out.sampled_token_ids.tolist(), out


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    expected = probs * n
    keep = expected > 0
    return (((counts - expected) ** 2)[keep] / expected[keep]).sum().item()


# Upper 0.1% points of the chi-square distribution, by degrees of freedom.
CHI2_999 = {4: 18.47, 7: 24.32, 9: 27.88, 15: 37.70}


def test_greedy_is_argmax_and_input_untouched():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 100, generator=g)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0) for _ in range(6)]
    toks, out = run(params, logits)
    assert toks == logits.argmax(-1).tolist()
    assert out.logprobs is None
    assert torch.equal(logits, before)
    # Random rows must not modify the caller's logits either.
    run([SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)] * 6, logits)
    assert torch.equal(logits, before)


def test_same_seed_same_tokens_and_steps_differ():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 64, generator=g).expand(32, 64).contiguous()
    params = [SamplingParams(temperature=1.5) for _ in range(32)]
    a, _ = run(params, logits, seeds=[7] * 32, outputs=[[1] * i for i in range(32)])
    b, _ = run(params, logits, seeds=[7] * 32, outputs=[[1] * i for i in range(32)])
    assert a == b
    assert len(set(a)) > 5  # different steps give different draws
    c, _ = run(params, logits, seeds=[8] * 32, outputs=[[1] * i for i in range(32)])
    assert c != a
    # Only the number of output tokens matters, not their values (preemption/recompute safe).
    d, _ = run(params, logits, seeds=[7] * 32, outputs=[[5] * i for i in range(32)])
    assert d == a


def test_batch_composition_does_not_change_a_request():
    g = torch.Generator().manual_seed(2)
    V = 300
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=3),
        SamplingParams(temperature=1.2, top_p=0.5),
        SamplingParams(temperature=0.5, min_p=0.2, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, logprobs=3),
    ]
    targets = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=1.1, top_k=50, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=0.0),
    ]
    for t_idx, target in enumerate(targets):
        for trial in range(20):
            row = torch.randn(1, V, generator=g) * 2
            seed, out = 1000 * t_idx + trial, [3] * trial
            alone, _ = run([target], row, outputs=[out], seeds=[seed])
            k = 1 + trial % len(others)
            batch_params = others[:k] + [target] + others[k:]
            logits = torch.randn(len(batch_params), V, generator=g)
            logits[k] = row[0]
            outs = [[9] * (i + 1) for i in range(len(batch_params))]
            outs[k] = out
            seeds = [seed + 17 * (i + 1) for i in range(len(batch_params))]
            seeds[k] = seed
            toks, _ = run(batch_params, logits, outputs=outs, seeds=seeds)
            assert toks[k] == alone[0], (t_idx, trial)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.0])
def test_distribution_matches_softmax(temperature):
    V, N = 8, 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    params = [SamplingParams(temperature=temperature)] * N
    toks, _ = run(params, logits.expand(N, V).contiguous(), seeds=list(range(N)))
    counts = torch.bincount(torch.tensor(toks), minlength=V).double()
    probs = torch.softmax(logits[0].double() / temperature, -1)
    assert chi_square(counts, probs) < CHI2_999[V - 1]


def test_distribution_over_steps_of_one_seed():
    # The stream of one request over its steps is as good as a stream over seeds.
    V, N = 10, 3000
    logits = torch.linspace(-1.0, 1.0, V).unsqueeze(0)
    params = [SamplingParams(temperature=1.0)] * N
    toks, _ = run(params, logits.expand(N, V).contiguous(), seeds=[123] * N,
                  outputs=[[0] * i for i in range(N)])
    counts = torch.bincount(torch.tensor(toks), minlength=V).double()
    assert chi_square(counts, torch.softmax(logits[0].double(), -1)) < CHI2_999[V - 1]


@pytest.mark.parametrize("other_top_k", [-1, 30])
def test_top_k_only_excludes_and_renormalises(other_top_k):
    g = torch.Generator().manual_seed(3)
    V, N, k = 40, 12000, 5
    logits = torch.randn(1, V, generator=g)
    top = set(logits[0].topk(k).indices.tolist())
    # Odd rows: no top-k (the batched threshold must handle disabled rows) or a larger one (the
    # candidate path with per-row k below the batch's largest).
    params = [SamplingParams(temperature=1.0, top_k=k if i % 2 == 0 else other_top_k) for i in range(N)]
    toks, _ = run(params, logits.expand(N, V).contiguous(), seeds=list(range(N)))
    chosen = torch.tensor(toks[0::2])
    assert set(chosen.tolist()) <= top
    assert len(set(toks[1::2]) - top) > 0
    counts = torch.bincount(chosen, minlength=V).double()
    probs = torch.full((V,), float("-inf"), dtype=torch.float64)
    idx = torch.tensor(sorted(top))
    probs[idx] = logits[0, idx].double()
    assert chi_square(counts, torch.softmax(probs, -1)) < CHI2_999[k - 1]


@pytest.mark.parametrize("top_k", [-1, 12])
def test_top_p_keeps_the_nucleus(top_k):
    V, N = 16, 12000
    probs = torch.tensor([0.30, 0.25, 0.15, 0.10, 0.05] + [0.15 / 11] * 11)
    logits = probs.log().unsqueeze(0)
    # Nucleus for p=0.75: {0.30, 0.25, 0.15, 0.10} (0.80 >= 0.75); the rest is excluded.
    params = [SamplingParams(temperature=1.0, top_p=0.75, top_k=top_k)] * N
    toks, _ = run(params, logits.expand(N, V).contiguous(), seeds=list(range(N)))
    assert set(toks) == {0, 1, 2, 3}
    counts = torch.bincount(torch.tensor(toks), minlength=V).double()
    expect = torch.zeros(V, dtype=torch.float64)
    expect[:4] = probs[:4].double() / probs[:4].sum()
    assert chi_square(counts, expect) < CHI2_999[3 + 1]


@pytest.mark.parametrize("all_top_k", [False, True])
def test_top_k_and_top_p_together_and_mixed_rows(all_top_k):
    # all_top_k: every row has a top_k, so the sampler works on the top-k candidates only;
    # otherwise it truncates and samples over the whole vocabulary.
    g = torch.Generator().manual_seed(4)
    V, N = 200, 3000
    logits = torch.randn(N, V, generator=g) * 3
    kinds = [
        dict(top_k=10),
        dict(top_p=0.6),
        dict(top_k=30, top_p=0.7),
        dict(min_p=0.3),
        dict(top_k=50, top_p=0.9, min_p=0.1),
        dict(),
    ]
    if all_top_k:
        kinds = [dict(k, top_k=k.get("top_k", 60)) for k in kinds]
    params = [SamplingParams(temperature=0.9, **kinds[i % len(kinds)]) for i in range(N)]
    toks, _ = run(params, logits)
    for i, (tok, p) in enumerate(zip(toks, params)):
        row = logits[i] / p.temperature
        order = row.argsort(descending=True)
        allowed = torch.ones(V, dtype=torch.bool)
        if p.top_k > 0:
            allowed &= row >= row[order[p.top_k - 1]]
        if p.top_p < 1.0:
            masked = torch.where(allowed, row, torch.tensor(float("-inf")))
            pr = torch.softmax(masked.double(), -1)
            srt, o = pr.sort(descending=True)
            cum_before = srt.cumsum(0) - srt
            nucleus = torch.zeros(V, dtype=torch.bool)
            nucleus[o[cum_before < p.top_p + 1e-6]] = True
            allowed &= nucleus
        if p.min_p > 0:
            pr = torch.softmax(row.double(), -1)
            allowed &= pr >= p.min_p * pr.max() * (1 - 1e-5)
        assert allowed[tok], (i, kinds[i % len(kinds)])


def test_min_p_excludes_unlikely_tokens():
    V, N = 6, 5000
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.04, 0.01])
    params = [SamplingParams(temperature=1.0, min_p=0.3)] * N  # threshold 0.12
    toks, _ = run(params, probs.log().expand(N, V).contiguous())
    assert set(toks) == {0, 1, 2}


def reference_process(logits, p, prompt, output):
    """Straightforward per-request version of the processing stages (float64)."""
    x = logits.clone().double()
    V = x.shape[0]
    if p.allowed_token_ids is not None:
        keep = torch.zeros(V, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        x[~keep] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if len(output) < p.min_tokens:
        for t in p.all_stop_token_ids:
            x[t] = float("-inf")
    seen = set(prompt) | set(output)
    for t in range(V):
        if t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        c = output.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    return x


def test_penalties_and_processing_match_reference():
    g = torch.Generator().manual_seed(5)
    V, B = 50, 12
    logits = torch.randn(B, V, generator=g) * 3
    prompts = [torch.randint(0, V, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
               for _ in range(B)]
    outputs = [torch.randint(0, V, (i * 3,), generator=g).tolist() for i in range(B)]
    params = []
    for i in range(B):
        p = SamplingParams(
            temperature=0.0,
            repetition_penalty=[1.0, 1.3, 0.7][i % 3],
            frequency_penalty=[0.0, 0.5, -0.4, 1.2][i % 4],
            presence_penalty=[0.0, 0.8, -1.0][(i // 2) % 3],
            allowed_token_ids=list(range(10, 40)) if i % 5 == 1 else None,
            logit_bias={3: 5.0, 11: -2.5} if i % 4 == 2 else None,
            min_tokens=[0, 4, 40][i % 3],
            max_tokens=100,
        )
        p.all_stop_token_ids = {1, 2, int(logits[i].argmax())}
        params.append(p)
    md = build_sampling_metadata(params, prompts, outputs, list(range(B)), V, CPU)
    from pagedllm.sample.penalties import process_logits_

    got = process_logits_(logits.clone(), md)
    for i in range(B):
        ref = reference_process(logits[i], params[i], prompts[i], outputs[i])
        assert torch.allclose(got[i].double(), ref, atol=1e-5), i
    toks, _ = run(params, logits, outputs=outputs, prompts=prompts)
    assert toks == got.argmax(-1).tolist()


def test_min_tokens_blocks_stop_tokens_until_reached():
    V = 10
    logits = torch.zeros(2, V)
    logits[:, 2] = 10.0  # EOS would win
    p = SamplingParams(temperature=0.0, min_tokens=3)
    p.all_stop_token_ids = {2}
    toks, _ = run([p, p], logits, outputs=[[5, 5], [5, 5, 5]])
    assert toks[0] != 2 and toks[1] == 2


def test_logprobs_are_raw_and_ranked():
    g = torch.Generator().manual_seed(6)
    V, B = 30, 6
    logits = torch.randn(B, V, generator=g) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=2, presence_penalty=1.5),
        SamplingParams(temperature=1.3, logprobs=5, top_k=4),
        SamplingParams(temperature=0.5, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_p=0.3, logprobs=1),
        SamplingParams(temperature=0.0, logit_bias={0: 20.0}, logprobs=3),
    ]
    toks, out = run(params, logits, outputs=[[1, 2, 3]] * B)
    lp = out.logprobs
    assert lp.token_ids.shape == (B, 6) and lp.logprobs.shape == (B, 6) and lp.ranks.shape == (B,)
    assert lp.token_ids.dtype == torch.int64 and lp.logprobs.dtype == torch.float32
    ref = torch.log_softmax(logits, -1)
    for i in range(B):
        assert lp.token_ids[i, 0].item() == toks[i]
        assert math.isclose(lp.logprobs[i, 0].item(), ref[i, toks[i]].item(), abs_tol=1e-6)
        order = ref[i].argsort(descending=True).tolist()
        assert lp.ranks[i].item() == order.index(toks[i]) + 1
        assert lp.token_ids[i, 1:].tolist() == order[:5]
        assert torch.allclose(lp.logprobs[i, 1:], ref[i, order[:5]])
    assert toks[5] == 0 and lp.ranks[5].item() > 1  # bias changed the pick, not the logprob


def test_compute_token_logprobs_for_prompts():
    from pagedllm.sample import compute_token_logprobs

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(9, 40, generator=g).to(torch.bfloat16)
    tokens = torch.randint(0, 40, (9,), generator=g)
    for k in (0, 3):
        lp = compute_token_logprobs(logits, tokens, k)
        ref = torch.log_softmax(logits.float(), -1)
        assert lp.token_ids.shape == (9, k + 1)
        assert lp.token_ids[:, 0].tolist() == tokens.tolist()
        assert torch.allclose(lp.logprobs[:, 0], ref.gather(1, tokens[:, None])[:, 0])
        ranks = [(ref[i] > ref[i, tokens[i]]).sum().item() + 1 for i in range(9)]
        assert lp.ranks.tolist() == ranks
        if k:
            assert torch.equal(lp.logprobs[:, 1:], ref.topk(k, -1).values)


def test_allowed_token_ids_only_picks_allowed():
    g = torch.Generator().manual_seed(8)
    V, N = 64, 500
    logits = torch.randn(N, V, generator=g)
    allowed = [5, 9, 33]
    params = [SamplingParams(temperature=2.0, allowed_token_ids=allowed) if i % 2 else SamplingParams()
              for i in range(N)]
    toks, _ = run(params, logits)
    assert set(toks[1::2]) == set(allowed)


@pytest.mark.parametrize("scale", [0.05, 3.0, 12.0])
def test_cpu_top_p_window_keeps_what_the_full_sort_keeps(scale):
    # The CPU path finds each row's top-p threshold among its best tokens (widening the window for flat
    # rows); the full sort (the CUDA path) must keep exactly the same tokens, ties at the threshold included.
    from pagedllm.sample.truncation import apply_top_k_top_p, sorted_threshold_

    g = torch.Generator().manual_seed(int(scale * 100))
    V = 5000
    logits = (torch.randn(8, V, generator=g) * scale).to(torch.bfloat16).float()  # bf16 values: many ties
    top_k = torch.tensor([V, 40, V, 2000, V, 7, V, V])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.95, 0.3, 1.0, 0.999, 0.6])
    got = apply_top_k_top_p(logits.clone(), top_k, top_p, max_top_k=2000)
    ref = logits.clone()
    threshold = sorted_threshold_(ref, top_k, top_p)
    ref.masked_fill_((ref < threshold) & (top_p < 1.0).unsqueeze(1), float("-inf"))
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    kept = (~torch.isinf(got)).sum(dim=1)
    assert kept[2] == V and kept[5] >= 7  # top_p 1.0 keeps all that top-k left
    # Ties at the threshold stay together: a kept value never also appears among the dropped ones.
    for r in range(8):
        kept_vals = set(logits[r][~torch.isinf(got[r])].tolist())
        dropped = logits[r][torch.isinf(got[r])].tolist()
        assert not kept_vals.intersection(dropped)


def _dense_counts(token_lists, vocab_size):
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.int32)
    for row, ids in enumerate(token_lists):
        for t in ids:
            counts[row, t] += 1
    return counts


@pytest.mark.parametrize("builder", ["cpu", "sync-free", "sync-free+triton"])
def test_sparse_penalties_equal_the_dense_ones_bit_for_bit(builder):
    # Penalties touch the seen tokens only: deduplicated on the CPU, once per occurrence on a GPU (the
    # sync-free builder, run here on the CPU), applied by torch ops or, on CUDA, by one Triton kernel
    # (here interpreted). All must give the dense [B, V] reference's floats.
    import dataclasses

    from pagedllm.sample.metadata import _scatter_mask, _seen_tokens_on_device
    from pagedllm.sample.penalties import apply_penalties_, process_logits_

    g = torch.Generator().manual_seed(11)
    V, B = 300, 9
    logits = torch.randn(B, V, generator=g) * 4
    logits[0, 5] = float("-inf")
    prompts = [torch.randint(0, V, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
               for _ in range(B)]
    outputs = [torch.randint(0, V, (i * 7,), generator=g).tolist() for i in range(B)]
    outputs[0] = [5, 5, 6]
    for reps in ([1.0, 1.3, 0.7], [1.0, 1.0, 1.0]):  # with and without a repetition penalty in the batch
        params = [SamplingParams(temperature=0.0, repetition_penalty=reps[i % 3],
                                 frequency_penalty=[0.0, 0.5, -0.4][i % 3], presence_penalty=[0.3, 0.0, -1.0][i % 3])
                  for i in range(B)]
        with_rep = any(r != 1.0 for r in reps)
        md = build_sampling_metadata(params, prompts, outputs, list(range(B)), V, CPU)
        assert md.seen_index is not None and md.repetition_seen == with_rep
        if builder != "cpu":
            index, counts = _seen_tokens_on_device(prompts if with_rep else None, outputs, V, CPU)
            assert index.numel() == sum(map(len, outputs)) + (sum(map(len, prompts)) if with_rep else 0)
            assert bool((index[1:] >= index[:-1]).all())
            md = dataclasses.replace(md, seen_index=index, seen_output_counts=counts)
        if builder == "sync-free+triton":
            from pagedllm.kernels.sampling.penalties import sparse_penalties_triton_

            # Compiled (with its exact-rounding instructions) where there is a GPU.
            dev = torch.device("cuda") if torch.cuda.is_available() else CPU
            index, counts = _seen_tokens_on_device(prompts if with_rep else None, outputs, V, dev)
            sparse = sparse_penalties_triton_(
                logits.clone().to(dev), index, counts,
                md.repetition_penalties.to(dev) if md.repetition_seen else None,
                md.frequency_penalties.to(dev), md.presence_penalties.to(dev),
            ).cpu()
        else:
            sparse = process_logits_(logits.clone(), md)
        dense = apply_penalties_(
            logits.clone(),
            _scatter_mask(list(enumerate(prompts)), B, V, CPU) if with_rep else None,
            _dense_counts(outputs, V),
            md.repetition_penalties, md.frequency_penalties, md.presence_penalties,
        )
        assert torch.equal(sparse, dense)
        assert not torch.equal(sparse, logits)
