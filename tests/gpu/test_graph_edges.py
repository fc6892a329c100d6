"""Programmatic edges into library kernels of captured graphs (worker/graph_edges.py): the race check tells a
kernel that waits on its predecessor from one that does not, and the engine links only checked kernels."""
from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA GPU of compute capability 9.0 (programmatic dependent launch)",
)

triton = pytest.importorskip("triton")
tl = triton.language


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
    from pagedllm.worker import graph_edges

    if not graph_edges.enabled(torch.device("cuda"), 1):
        pytest.skip("graph edges cannot be edited here (driver or torch too old, or PAGEDLLM_PDL=0)")
    src = torch.randn(64, 1024, device="cuda")
    linked, err = graph_edges.race(lambda x: _scale(x, wait), src, spin=200_000)
    assert linked == ["_scale_kernel"]
    if wait:
        assert err == 0.0
    else:
        # It read the zeroed buffer while the copy was still spinning: twice the input, not zero, is missing.
        assert err == pytest.approx(2 * src.abs().max().item())


def test_engine_links_only_checked_cublas_kernels(tmp_path):
    from pagedllm import LLM, SamplingParams
    from pagedllm.worker import graph_edges
    from tiny_models import make_tiny_model

    if not graph_edges.enabled(torch.device("cuda"), 1):
        pytest.skip("graph edges cannot be edited here")
    path = make_tiny_model("qwen3", tmp_path / "qwen3")
    llm = LLM(model=path, skip_tokenizer_init=True, max_num_seqs=8, max_model_len=256, seed=0, device="cuda",
              dtype="bfloat16", kv_cache_memory_bytes=64 << 20)
    linker = graph_edges.shared_linker()
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    # Every product shape of the decode graphs (2-8 rows; one row is the GEMV) was checked.
    assert linker._checked, "no library product was recorded while capturing"
    assert not (linker.waits & linker.never)
    if linker.waits - linker.never:
        assert runner.graph_runner.library_edges > 0
    # A linked graph still generates (its bits against unlinked graphs: test_runner_gpu.py's PDL test).
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=6, ignore_eos=True,
                                                                           detokenize=False), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    del llm
    gc.collect()
    torch.cuda.empty_cache()
