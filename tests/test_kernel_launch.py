"""Programmatic dependent launch: on by default where the GPU has it, off on request; its kernel variants compile for sm_90."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm.kernels import launch
from pagedllm.kernels.launch import PDL_MAX_TOKENS, pdl_launch_args, use_pdl


@pytest.fixture
def pdl_setting(monkeypatch):
    """``launch.set_pdl`` for one test: the process-wide setting is given back afterwards."""
    monkeypatch.setattr(launch, "_pdl_enabled", launch._pdl_enabled)
    return launch.set_pdl


def test_pdl_is_off_on_cpu_even_when_asked(pdl_setting):
    pdl_setting(True)
    t = torch.zeros(2)
    assert not use_pdl(t)
    assert pdl_launch_args(t) == {"USE_GDC": False}


def test_pdl_is_on_by_default_where_the_gpu_has_it(pdl_setting):
    assert pdl_launch_args(torch.zeros(1)) == {"USE_GDC": False}
    if torch.cuda.is_available():
        on = torch.cuda.get_device_capability()[0] >= 9
        assert pdl_launch_args(torch.zeros(1, device="cuda")) == (
            {"USE_GDC": True, "launch_pdl": True} if on else {"USE_GDC": False}
        )
        # A long prefill launches without it.
        assert not use_pdl(torch.zeros(PDL_MAX_TOKENS + 1, 8, device="cuda"))
        assert use_pdl(torch.zeros(PDL_MAX_TOKENS, 8, device="cuda")) == on
        pdl_setting(False)
        assert not use_pdl(torch.zeros(1, device="cuda"))


def _hopper_compile(*args: str) -> list[dict]:
    """``hopper_compile.py``'s JSON lines, run in a process without the interpreter (skips without ptxas)."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton has no bundled ptxas")
    tests_dir = Path(__file__).parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tests_dir.parent), str(tests_dir), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(tests_dir / "hopper_compile.py"), *args], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_pdl_kernels_compile_for_hopper():
    # The PDL variants never run on a CPU; compiling them for sm_90 checks that each kernel waits on its
    # predecessor (griddepcontrol.wait) and that the small ones let their successor launch early.
    rows = _hopper_compile()
    seen = {r["kernel"] for r in rows}
    assert seen == {"_gemv_kernel", "_skinny_gemm_kernel", "_rmsnorm_kernel", "_act_and_mul_kernel", "_rotary_kernel",
                    "_qk_norm_rotary_kernel", "_paged_attention_kernel", "_reduce_splits_kernel",
                    "_reshape_and_cache_kernel", "_piece_ends_kernel", "_decode_pieces_kernel", "_quant_rows_kernel",
                    "_act_and_mul_quant_kernel", "_chunk_argmax_kernel", "_row_argmax_kernel", "_w8a8_kernel",
                    "_scale_rows_kernel"}
    assert all(r["pdl"] and r["wait"] >= 1 for r in rows), rows
    # Small grids, and the skinny GEMM at <= 16 rows (whose successor then loads its weights during it).
    small = {"_rmsnorm_kernel", "_act_and_mul_kernel", "_rotary_kernel", "_qk_norm_rotary_kernel",
             "_reduce_splits_kernel", "_reshape_and_cache_kernel", "_skinny_gemm_kernel", "_piece_ends_kernel",
             "_row_argmax_kernel"}
    assert all(r["trigger"] >= 1 for r in rows if r["kernel"] in small), rows
    # Rotary arithmetic rounds each product and sum like torch (kernel_math.rope_combine): no fused half
    # multiply-add may survive compilation in any kernel.
    assert all(r["half_fma"] == 0 for r in rows), rows


def test_quantized_products_fit_hopper_shared_memory():
    """The grouped MoE GEMM over packed 4/8-bit, block-float8 and int8 experts at every config of its tile table, and the
    block-float8 GEMM, compiled for sm_90: each within shared memory with room to spare (an H100's compile of one
    packed variant needed 1.4x this offline figure; the limit is 227 KiB a block)."""
    rows = _hopper_compile("--shared-memory")
    assert len(rows) == 35 and {r["kernel"] for r in rows} == {"_grouped_gemm_kernel", "_fp8_block_gemm_kernel"}
    assert all(r["shared"] <= 227 * 1024 / 1.4 for r in rows), [r for r in rows if r["shared"] > 227 * 1024 / 1.4]


def test_inline_ptx_compiles_for_hopper():
    """The W4A16 GEMV, tiles and MoE experts on pairs of 16-bit values carry PTX of their own, which only a GPU runs: compiled for
    sm_90 (ptxas reads it), in bfloat16 and float16, each launch keeps its packed multiply-adds."""
    rows = _hopper_compile("--inline-ptx")
    assert len(rows) == 10 and {r["kernel"] for r in rows} == {"_wna16_gemv_pairs_kernel", "_wna16_kernel",
                                                               "_grouped_gemm_kernel"}
    assert all(r["half2"] >= 8 for r in rows), rows
