"""GGUF experts kept in their ggml blocks (layers/fused_moe/gguf_experts.py) against the reference on the same experts
dequantized: one layer's output, gate and up of two types, the tensor-parallel split of the rows, 8-bit decode
activations, and the refusals."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402

from pagedllm.kernels.cpu import gguf_gemm  # noqa: E402
from pagedllm.layers.fused_moe import MoEExperts, fused_experts_ref, select_experts  # noqa: E402
from pagedllm.layers.fused_moe import gguf_experts  # noqa: E402
from pagedllm.layers.fused_moe.layer import default_experts_method  # noqa: E402

pytestmark = pytest.mark.skipif(not gguf_gemm.available(), reason="the packed GGUF CPU kernel is not available")

E, TOP_K, H, I = 4, 2, 64, 128


def _experts(types: tuple[T, T, T], seed: int = 0) -> dict[str, list[np.ndarray]]:
    """Random gate [I, H], up [I, H] and down [H, I] of every expert, as blocks of ``types``."""
    rng = np.random.default_rng(seed)
    shapes = {"w1": (I, H), "w3": (I, H), "w2": (H, I)}
    return {sid: [gguf.quants.quantize((rng.standard_normal(shapes[sid]) / 8).astype(np.float32), t) for _ in range(E)]
            for sid, t in zip(shapes, types)}


def _layer(blocks: dict, types: tuple[T, T, T], tp_rank: int = 0, tp_size: int = 1, int8: bool = False) -> MoEExperts:
    with default_experts_method(gguf_experts.GGUFExpertsMethod(int8)):
        layer = MoEExperts(E, TOP_K, H, I, renormalize=True, params_dtype=torch.float32, tp_rank=tp_rank,
                           tp_size=tp_size)
    for sid, qtype in zip(("w1", "w3", "w2"), types):
        key = "w2" if sid == "w2" else "w13"
        kind, rows = getattr(layer, key + "_qweight_type"), getattr(layer, key + "_qweight")
        for e in range(E):
            kind.weight_loader(kind, torch.tensor(int(qtype)), sid, e)
            rows.weight_loader(rows, torch.from_numpy(blocks[sid][e]), sid, e)
    assert all(getattr(layer, name).all_loaded() for name in ("w13_qweight_type", "w13_qweight", "w2_qweight_type",
                                                              "w2_qweight"))
    gguf_experts.finish_loading(layer)
    return layer


def _dequantized(blocks: dict, types: tuple[T, T, T]) -> tuple[torch.Tensor, torch.Tensor]:  # [E, 2I, H], [E, H, I]
    w = {sid: torch.stack([torch.from_numpy(gguf.quants.dequantize(b, t)) for b in blocks[sid]])
         for sid, t in zip(("w1", "w3", "w2"), types)}
    return torch.cat([w["w1"], w["w3"]], dim=1), w["w2"]


def _inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H], router logits [T, E]
    g = torch.Generator().manual_seed(tokens)
    return torch.randn(tokens, H, generator=g), torch.randn(tokens, E, generator=g)


def _assert_relative(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= rel, f"outputs differ by {err:.2e} of their largest magnitude (limit {rel})"


@pytest.mark.parametrize("types", [(T.Q8_0, T.Q8_0, T.Q5_0), (T.Q8_0, T.Q4_0, T.Q5_0)], ids=["merged", "apart"])
@pytest.mark.parametrize("tokens", [3, 40])  # decode rows (fused products), and a prompt's (decoded then torch.mm)
def test_packed_layer_equals_reference_on_dequantized_experts(types, tokens: int) -> None:
    blocks = _experts(types)
    layer = _layer(blocks, types)
    if types[0] == types[1]:  # gate then up rows of each expert, one segment
        assert layer.gguf_w13 == (("w13_qweight", int(types[0])),)
        assert layer.w13_qweight.dtype == torch.uint8 and tuple(layer.w13_qweight.shape) == (E, 2 * I, H // 32 * 34)
        assert torch.equal(layer.w13_qweight[1, I:], torch.from_numpy(blocks["w3"][1]))
    else:
        assert [name for name, _ in layer.gguf_w13] == ["w1_qweight", "w3_qweight"]
    assert tuple(layer.w2_qweight.shape) == (E, H, I // 32 * 22)
    x, logits = _inputs(tokens)
    w13, w2 = _dequantized(blocks, types)
    weights, ids = select_experts(logits, TOP_K, True)
    _assert_relative(layer(x, logits), fused_experts_ref(x, w13, w2, weights, ids))


def test_tensor_parallel_ranks_sum_to_the_whole_layer() -> None:
    """Each rank keeps its share of every expert's gate/up rows and whole blocks of its down rows."""
    types = (T.Q8_0, T.Q8_0, T.Q4_0)
    blocks = _experts(types, seed=1)
    whole = _layer(blocks, types)
    ranks = [_layer(blocks, types, tp_rank=r, tp_size=2) for r in range(2)]
    assert tuple(ranks[1].w13_qweight.shape) == (E, I, H // 32 * 34)
    assert tuple(ranks[1].w2_qweight.shape) == (E, H, I // 2 // 32 * 18)
    assert torch.equal(ranks[1].w2_qweight[2], torch.from_numpy(blocks["w2"][2])[:, I // 2 // 32 * 18:])
    x, logits = _inputs(5)
    weights, ids = select_experts(logits, TOP_K, True)
    partial = sum(rank._local_experts(x, weights, ids) for rank in ranks)
    torch.testing.assert_close(partial, whole._local_experts(x, weights, ids), rtol=1e-4, atol=1e-5)


def test_tensor_parallel_split_inside_a_block_is_refused() -> None:
    types = (T.Q8_0, T.Q8_0, T.Q8_0)
    with pytest.raises(ValueError, match="split each expert's down projection at 16 of its 128 inputs, inside Q8_0's "
                                         "32-input blocks; use --enable-expert-parallel"):
        _layer(_experts(types), types, tp_rank=0, tp_size=8)


def test_int8_activations_take_decode_rows_only() -> None:
    types = (T.Q8_0, T.Q8_0, T.Q8_0)
    blocks = _experts(types, seed=2)
    exact, int8 = _layer(blocks, types), _layer(blocks, types, int8=True)
    decode, _ = _inputs(3)
    prompt, _ = _inputs(40)
    for x in (decode, prompt):
        weights, ids = select_experts(torch.randn(x.shape[0], E), TOP_K, True)
        got, want = int8._local_experts(x, weights, ids), exact._local_experts(x, weights, ids)
        if x.shape[0] > gguf_gemm.Q8_MAX_ROWS:
            assert torch.equal(got, want)  # a prompt's rows stay float32
        else:
            assert not torch.equal(got, want)
            _assert_relative(got, want, rel=2e-2)  # llama.cpp's 8-bit activations: close, not exact


def test_pieces_of_the_wrong_shape_or_order_are_refused() -> None:
    with default_experts_method(gguf_experts.GGUFExpertsMethod()):
        layer = MoEExperts(E, TOP_K, H, I, renormalize=True, params_dtype=torch.float32)
    rows, kind = layer.w13_qweight, layer.w13_qweight_type
    with pytest.raises(ValueError, match="rows of expert 0 w1 arrived before its qweight_type"):
        rows.weight_loader(rows, torch.zeros(I, 68, dtype=torch.uint8), "w1", 0)
    kind.weight_loader(kind, torch.tensor(int(T.Q8_0)), "w1", 0)
    with pytest.raises(ValueError, match=r"expert w1 of type Q8_0 has shape \(128, 64\); the layer takes \(128, 68\)"):
        rows.weight_loader(rows, torch.zeros(I, 64, dtype=torch.uint8), "w1", 0)
    with pytest.raises(ValueError, match="expert 1 w1 has type Q4_0; the layer's other experts of that projection "
                                         "have Q8_0"):
        kind.weight_loader(kind, torch.tensor(int(T.Q4_0)), "w1", 1)
    assert not kind.all_loaded() and not rows.all_loaded()
