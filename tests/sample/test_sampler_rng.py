"""Tests for the counter-based random numbers behind seeded sampling."""
from __future__ import annotations

import pytest
import torch

from pagedllm.sample.rng import bits_to_uniform, gumbel, random_bits, row_key, vocab_ids


def keys(pairs):
    ks = [row_key(s, t) for s, t in pairs]
    return torch.tensor([k[0] for k in ks]), torch.tensor([k[1] for k in ks])


def test_row_key_is_a_pure_function_of_seed_and_step():
    assert row_key(5, 3) == row_key(5, 3)
    distinct = {row_key(s, t) for s in (-(2**70), -1, 0, 1, 2**63, 2**64 + 1) for t in range(50)}
    assert len(distinct) == 6 * 50
    for s, t in [(0, 0), (2**80, 7), (-3, 2)]:
        k0, k1 = row_key(s, t)
        assert 0 <= k0 < 2**32 and 0 <= k1 < 2**32


def test_uniform_extremes_stay_strictly_inside_unit_interval():
    # Every possible bucket, including the two ends, maps to a finite Gumbel value.
    top = torch.tensor([0, 1, 2**32 - 1, 2**32 - 2**9, 2**31], dtype=torch.int64)
    u = bits_to_uniform(top)
    assert bool(((u > 0) & (u < 1)).all())
    assert bool(torch.isfinite(-torch.log(-torch.log(u))).all())


def test_bits_are_in_range_balanced_and_uncorrelated():
    k0, k1 = keys([(s, 0) for s in range(200)] + [(0, t) for t in range(1, 200)])
    bits = random_bits(k0, k1, vocab_ids(1000, k0.device))
    assert bits.dtype == torch.int64 and int(bits.min()) >= 0 and int(bits.max()) < 2**32
    ones = torch.stack([(bits >> i) & 1 for i in range(32)]).double().mean(dim=(1, 2))
    assert bool(((ones - 0.5).abs() < 0.005).all())
    u = bits_to_uniform(bits).double()
    assert abs(u.mean().item() - 0.5) < 0.003 and abs(u.var().item() - 1 / 12) < 0.002
    for a, b in [(u[:, :-1], u[:, 1:]), (u[:-1], u[1:])]:
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()) < 0.01


def test_keys_differing_by_a_constant_are_not_shifted_copies():
    # The first round alone would make rows whose key0 differ by 3 shifted copies; the second,
    # keyed by key1, breaks that (row keys come from a 64-bit hash, so key1 differs too).
    k0 = torch.tensor([1000, 1000 + 3])
    k1 = torch.tensor([77, 78])
    bits = random_bits(k0, k1, vocab_ids(64, k0.device))
    assert int((bits[0, 3:] == bits[1, :-3]).sum()) == 0


def test_gumbel_moments():
    k0, k1 = keys([(s, 1) for s in range(200)])
    g = gumbel(k0, k1, vocab_ids(5000, k0.device)).double()
    assert bool(torch.isfinite(g).all())
    assert abs(g.mean().item() - 0.5772) < 0.01  # Euler-Mascheroni constant
    assert abs(g.var().item() - torch.pi**2 / 6) < 0.03


def test_noise_for_chosen_ids_equals_noise_over_the_vocabulary():
    k0, k1 = keys([(s, s % 3) for s in range(8)])
    full = gumbel(k0, k1, vocab_ids(300, k0.device))
    ids = torch.randint(0, 300, (8, 17), generator=torch.Generator().manual_seed(0))
    assert torch.equal(gumbel(k0, k1, ids), full.gather(1, ids))


@pytest.mark.parametrize("scale", [0.01, 3.0, 30.0])
def test_gumbel_argmax_picks_what_noise_over_the_whole_vocabulary_picks(scale):
    # Off CUDA, gumbel_argmax gives noise only to tokens that could still win (or to all, for flat rows);
    # the pick must be the full computation's, first index among equal maxima included.
    from pagedllm.sample.rng import gumbel_argmax

    g = torch.Generator().manual_seed(int(scale * 10))
    R, V = 12, 20000
    logits = torch.randn(R, V, generator=g) * scale
    logits[0, : V // 2] = float("-inf")
    logits[1] = logits[1].round()  # many exact ties
    k0, k1 = keys([(s, s % 5) for s in range(R)])
    full = (logits + gumbel(k0, k1, vocab_ids(V, logits.device))).argmax(dim=-1)
    assert torch.equal(gumbel_argmax(logits.clone(), k0, k1), full)
