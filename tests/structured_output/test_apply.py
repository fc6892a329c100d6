"""The grammar bitmask applied to CPU logits (``structured_output/apply.py``) against xgrammar's own kernel."""
from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from pagedllm.structured_output.apply import apply_grammar_bitmask


def _bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:  # [rows, ceil(vocab / 32)] int32
    """Every kind of word a grammar leaves: all tokens masked, all allowed, a few allowed, and random bits."""
    g = torch.Generator().manual_seed(seed)
    width = (vocab + 31) // 32
    bm = torch.randint(-2**31, 2**31 - 1, (rows, width), generator=g, dtype=torch.int32)
    bm[:, width // 2:] = 0
    bm[:, width // 4: width // 3] = -1
    bm[:, 0] = 1 << 5
    bm[:, 1] = -(2**31)  # only the word's last token
    return bm


@pytest.mark.parametrize("vocab", [1000, 1024, 262144])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_mask_matches_xgrammar(vocab, dtype):
    rows = 5
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits[0, 7] = float("inf")  # a disallowed +inf and an allowed NaN stay what xgrammar makes them
    logits[0, 37] = float("nan")
    bm = _bitmask(rows, vocab, seed=2)
    req_ids = [f"r{i}" for i in range(rows)]
    for grammar_rows in ({rid: i for i, rid in enumerate(req_ids)},  # every row constrained, in order
                         {"r1": 0, "r3": 2, "r4": 4}):  # some rows, reading other bitmask rows
        want = logits.clone()
        aligned = torch.full_like(bm, -1)
        targets = sorted(int(r[1:]) for r in grammar_rows)
        for rid, src in grammar_rows.items():
            aligned[int(rid[1:])] = bm[src]
        xgr.apply_token_bitmask_inplace(want, aligned, vocab_size=vocab, indices=targets)
        got = logits.clone()
        apply_grammar_bitmask(got, req_ids, grammar_rows, bm)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
        untouched = [i for i in range(rows) if i not in targets]
        assert torch.equal(got[untouched].nan_to_num(0.0), logits[untouched].nan_to_num(0.0))


def test_cpu_mask_refuses_a_bitmask_narrower_than_the_vocabulary():
    logits = torch.zeros(1, 100)
    with pytest.raises(Exception):
        apply_grammar_bitmask(logits, ["a"], {"a": 0}, torch.full((1, 2), -1, dtype=torch.int32))
