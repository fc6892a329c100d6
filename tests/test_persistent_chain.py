"""The persistent-chain benchmark's kernel (benchmarks/persistent_chain.py) computes the chain it times:
one program under the interpreter, float32, split and unsplit products, against the same chain in torch."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import persistent_chain as pc  # noqa: E402 - a benchmark script, imported from its folder


@pytest.mark.parametrize("cfg", [
    pc.ChainConfig(1, (32, 16, 32, 16), (1, 1, 1, 1), 32),
    pc.ChainConfig(1, (32, 16, 32, 16), (1, 2, 1, 2), 32),
    pc.ChainConfig(1, (16, 16, 16, 16), (1, 4, 1, 4), 16),
])
def test_chain_kernel_matches_torch_in_float32(cfg):
    chain = pc.Chain("", rows=5, dtype=torch.float32, device="cpu", shapes=(64, 128, 64, 128, 2), seed=1)
    chain.check_config(cfg)
    ref = chain.reference()
    chain.launch(cfg)
    assert chain.err.item() == 0
    assert pc.max_rel_err(chain.x, ref) < 1e-5
    assert chain.count.abs().sum().item() == 0  # every split tile's count back at zero
    assert chain.sync.item() == 4 * 2  # one arrival a product a layer, one program


def test_chain_config_that_does_not_divide_is_named():
    chain = pc.Chain("", rows=5, dtype=torch.float32, device="cpu", shapes=(64, 128, 64, 128, 1))
    with pytest.raises(ValueError, match="input 64 by 4 x 32"):
        chain.check_config(pc.ChainConfig(1, (32, 16, 32, 16), (1, 4, 1, 1), 32))
    with pytest.raises(ValueError, match="whole input rows"):
        chain.check_config(pc.ChainConfig(1, (32, 16, 32, 16), (2, 1, 1, 1), 16))
