"""Rows a norm or gated activation kernel hands to a float8 or W8A8 int8 linear already quantized
(``kernels/row_quant.py``, ``layers/quantization/fused_rows.py``), under Triton's interpreter: the producers store
the rows and scales the linear's own quantizer would, every int8 product path given those rows returns the bits it
returns for the 16-bit rows, and a loaded model flags each producer with the kind of rows its linear quantizes to."""
from __future__ import annotations

import pytest
import torch
from test_int8_triton import _rows  # rows of very different ranges, a run of equal values, a row of zeros
from tiny_models import make_tiny_model

from pagedllm import LLM
from pagedllm.kernels import activation as act_k
from pagedllm.kernels import fp8_quant, int8_gemm, int8_quant, launch
from pagedllm.kernels import rmsnorm as norm_k
from pagedllm.kernels.row_quant import QuantizedRows
from pagedllm.layers.quantization.int8 import W8A8Int8LinearMethod, fuse_wanted, w8a8_linear

pytestmark = [pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")]


def _same_rows(fused: QuantizedRows, kind: str, plain: torch.Tensor) -> None:
    """``fused`` holds the rows, scales (and zero points) the consumer's own quantizer makes of the 16-bit ``plain``
    rows."""
    if kind == "int8_zp":
        q, s, z = int8_quant.quantize_rows_with_zeros(plain)
        assert torch.equal(fused.zeros, z) and z.abs().max() > 0
    else:
        (q, s), z = (fp8_quant if kind == "fp8" else int8_quant).quantize_rows(plain), None
        assert fused.zeros is None
    assert isinstance(fused, QuantizedRows) and fused.kind == kind and fused.dtype == plain.dtype
    assert fused.q.dtype == q.dtype and fused.shape == plain.shape
    assert torch.equal(fused.scales, s) and torch.equal(fused.q.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("kind", ["int8", "fp8", "int8_zp"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("gemma", [False, True])
def test_norm_kernel_stores_the_quantized_rows_of_its_output(kind: str, dtype, residual: bool, gemma: bool) -> None:
    gen = torch.Generator().manual_seed(21)
    x = (torch.randn(5, 320, generator=gen) * torch.logspace(-2, 2, 5)[:, None]).to(dtype)
    x[3] = 0.0  # with no residual, a row of zeros: the smallest scale
    res = torch.randn(5, 320, generator=gen).to(dtype) if residual else None
    w = (torch.randn(320, generator=gen) * 0.2 + (0.0 if gemma else 1.0)).to(dtype)
    plain = norm_k.rms_norm(x, w, 1e-6, res, gemma=gemma)
    fused = norm_k.rms_norm(x, w, 1e-6, res, gemma=gemma, quantize=kind)
    if residual:
        (plain, plain_res), (fused, fused_res) = plain, fused
        assert torch.equal(plain_res, fused_res)
    _same_rows(fused, kind, plain)


@pytest.mark.parametrize("kind", ["int8", "fp8", "int8_zp"])
@pytest.mark.parametrize("whole_row_max", [16384, 512])  # the row's products computed once, or twice
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_activation_kernel_stores_the_quantized_rows_of_its_output(kind: str, act: str, whole_row_max: int,
                                                                   monkeypatch) -> None:
    monkeypatch.setattr(launch, "WHOLE_ROW_MAX", whole_row_max)
    gen = torch.Generator().manual_seed(22)
    x = (torch.randn(4, 2 * 1300, generator=gen) * 2).half()  # 1300: two column blocks, one partial
    _same_rows(act_k.act_and_mul(x, act, quantize=kind), kind, act_k.act_and_mul(x, act))


def _weight(n: int, k: int, seed: int):  # int8 [n, k], scales [n, 1], bias [n]
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, 1, generator=g) * 1e-2,
            (torch.randn(n, generator=g) * 0.1).half())


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("split_k", [1, 3])  # one program a tile, or K in three summed by the last to finish
def test_decode_kernel_reads_producer_rows(m: int, split_k: int) -> None:
    x = _rows(m, 300, torch.float16, seed=m)
    w, ws, b = _weight(40, 300, seed=8)
    rows = QuantizedRows(*int8_quant.quantize_rows(x), x.dtype)
    want = w8a8_linear(x, w, ws, b, act_symmetric=True)
    assert int8_gemm.usable(rows, w.cuda() if torch.cuda.is_available() else w) == torch.cuda.is_available()
    got = int8_gemm.w8a8_decode(rows, w, ws, b, block_n=16, block_k=64, split_k=split_k)
    assert got.dtype == torch.float16 and torch.equal(got, want)
    assert torch.equal(w8a8_linear(rows, w, ws, b, act_symmetric=True), want)  # the torch path from the rows


@pytest.mark.parametrize("m", [1, 16, 70])
def test_every_path_reads_producer_rows_with_zero_points(m: int) -> None:
    from test_int8_triton import _skewed_rows

    x = _skewed_rows(m, 300, torch.float16, seed=m)
    w, ws, b = _weight(40, 300, seed=14)
    sums = w.sum(dim=1, dtype=torch.int32).float()
    q, s, z = int8_quant.quantize_rows_with_zeros(x)
    rows = QuantizedRows(q, s, x.dtype, z)
    want = w8a8_linear(x, w, ws, b, act_symmetric=False)
    if m <= int8_gemm.MAX_ROWS:
        got = int8_gemm.w8a8_decode(rows, w, ws, b, block_n=16, block_k=64, weight_row_sums=sums)
    else:
        got = int8_gemm.w8a8_tiles(rows, w, ws, b, config=int8_gemm.TileConfig(64, 32, 64, 4, 2), weight_row_sums=sums)
    assert torch.equal(got, want)
    assert torch.equal(w8a8_linear(rows, w, ws, b, act_symmetric=False, row_sums=sums), want)
    with pytest.raises(ValueError, match="weight_row_sums: given exactly when the QuantizedRows carry zero points"):
        int8_gemm.w8a8_decode(rows if m <= 16 else QuantizedRows(q[:16], s[:16], x.dtype, z[:16]), w, ws, b)


def test_tiles_read_producer_rows() -> None:
    x = _rows(70, 300, torch.float16, seed=70)
    w, ws, b = _weight(40, 300, seed=9)
    rows = QuantizedRows(*int8_quant.quantize_rows(x), x.dtype)
    got = int8_gemm.w8a8_tiles(rows, w, ws, b, config=int8_gemm.TileConfig(64, 32, 64, 4, 2, 2))
    assert torch.equal(got, w8a8_linear(x, w, ws, b, act_symmetric=True))


def test_rows_that_do_not_match_their_kernel_are_refused() -> None:
    w, ws, _ = _weight(40, 300, seed=10)
    q, s = int8_quant.quantize_rows(_rows(2, 300, torch.float16, seed=2))
    with pytest.raises(ValueError, match=r"QuantizedRows of int8 and \[M, 1\] float32 scales.*scales "
                                         r"torch.float32 \(1, 1\)"):
        int8_gemm.w8a8_decode(QuantizedRows(q, s[:1], torch.float16), w, ws)
    with pytest.raises(ValueError, match="QuantizedRows of int8"):
        int8_gemm.w8a8_decode(QuantizedRows(q.float().to(torch.float8_e4m3fn), s, torch.float16), w, ws)


def test_only_products_of_symmetric_weights_on_cuda_take_producer_rows() -> None:
    assert W8A8Int8LinearMethod("symmetric").quantized_input(None) == "int8"
    assert W8A8Int8LinearMethod("asymmetric").quantized_input(None) == "int8_zp"  # a zero point per token
    assert W8A8Int8LinearMethod("symmetric", weight_symmetric=False).quantized_input(None) is None
    assert W8A8Int8LinearMethod(None).quantized_input(None) is None  # W8A16: 16-bit activations
    assert not fuse_wanted(torch.zeros(3, 64, dtype=torch.float16), (32, 64))  # the CPU quantizes in its product


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fused-rows")
    return {kind: make_tiny_model(kind, root / kind) for kind in ("llama", "gemma3")}


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("quantization", [None, "int8", "fp8"])
def test_loaded_models_flag_the_producers_of_quantized_inputs(tiny_models, kind: str, quantization) -> None:
    llm = LLM(model=tiny_models[kind], dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22,
              max_model_len=64, skip_tokenizer_init=True, quantization=quantization)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    for layer in model.model.layers:
        mlp_norm = layer.pre_feedforward_layernorm if kind == "gemma3" else layer.post_attention_layernorm
        producers = (layer.input_layernorm, mlp_norm, layer.mlp.act_fn)
        assert [p.quantize_output for p in producers] == [quantization] * 3
        assert layer.mlp.act_fn.quantize_for == tuple(layer.mlp.down_proj.weight.shape)
    assert model.model.norm.quantize_output is None  # the final norm feeds the 16-bit LM head
    if kind == "gemma3":
        assert all(layer.post_feedforward_layernorm.quantize_output is None for layer in model.model.layers)


@pytest.mark.parametrize(("name", "kind"), [("ct-w8a8", "int8"), ("ct-w8a8-asym-act", "int8_zp")])
def test_w8a8_checkpoints_flag_their_kind_of_rows(name: str, kind: str) -> None:
    pytest.importorskip("compressed_tensors")
    import quant_checkpoints as qc

    llm = LLM(model=qc.make_ct(name), dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22, max_model_len=64,
              skip_tokenizer_init=True)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    layer = model.model.layers[0]
    assert [p.quantize_output for p in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.act_fn)] == \
        [kind] * 3
    assert (getattr(layer.mlp.down_proj, "weight_row_sums", None) is not None) == (kind == "int8_zp")
