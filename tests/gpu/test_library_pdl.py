"""benchmarks/library_pdl.py's race tells a kernel that waits on its predecessor from one that reads at once:
the instrument behind the finding that cuBLAS's products cannot be launched early (docs/benchmarks.md)."""
from __future__ import annotations

import pathlib
import runpy

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA GPU of compute capability 9.0 (programmatic dependent launch)",
)

triton = pytest.importorskip("triton")
tl = triton.language
_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "library_pdl.py"


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, WAIT: tl.constexpr, BLOCK: tl.constexpr):
    if WAIT:
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, x * 2.0, mask=offs < n)


def _scale(x: torch.Tensor, wait: bool) -> torch.Tensor:
    out = torch.empty_like(x)
    _scale_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), WAIT=wait, BLOCK=1024)
    return out


@pytest.mark.parametrize("wait", [True, False])
def test_race_tells_a_waiting_kernel_from_one_that_reads_at_once(wait):
    bench = runpy.run_path(str(_SCRIPT))
    if bench["_driver"]() is None:
        pytest.skip("this driver cannot edit graph edges")
    src = torch.randn(64, 1024, device="cuda")
    linked, err = bench["race"](lambda x: _scale(x, wait), src, spin=200_000)
    assert linked == ["_scale_kernel"]
    if wait:
        assert err == 0.0
    else:
        # It read the zeroed buffer while the copy still spun: all of 2 * src is missing.
        assert err == pytest.approx(2 * src.abs().max().item())
