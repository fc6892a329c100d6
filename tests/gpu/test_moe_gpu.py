"""The Triton MoE kernels on a real GPU: bf16/fp16 parity with the per-expert reference at decode and prefill
sizes (16-bit and float8 experts), the layer's choice of them on CUDA, CUDA-graph safety, and a MoE model's
greedy tokens against the CPU (16-bit, and float8 experts against the same experts dequantized)."""
from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from pagedllm.kernels.moe import fused_experts
from pagedllm.layers.fused_moe import MoEExperts, fused_experts_ref, select_experts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = torch.device("cuda")


def _case(tokens, num_experts, top_k, hidden, inter, dtype, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=DEVICE).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g, device=DEVICE) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g, device=DEVICE) * inter**-0.5).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=g, device=DEVICE)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 16, 256, 4096])
def test_fused_experts_matches_reference(tokens, dtype):
    # A Qwen3-30B-A3B layer, narrowed: 128 experts, top-8.
    x, w13, w2, weights, ids = _case(tokens, 128, 8, 512, 192, dtype)
    got = fused_experts(x, w13, w2, weights, ids)
    want = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [E, N, K] -> float8 [E, N, K], [E, N] float32
    amax = w.float().abs().amax(dim=-1).clamp(min=1e-12)
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    return (w.float() / scale[:, :, None]).to(torch.float8_e4m3fn), scale.contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 16, 256, 4096])
def test_fused_fp8_experts_match_dequantized_reference(tokens, dtype):
    x, w13, w2, weights, ids = _case(tokens, 128, 8, 512, 192, dtype, seed=1)
    (q13, s13), (q2, s2) = _fp8(w13), _fp8(w2)
    got = fused_experts(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    # the oracle: the float8 rows dequantized through float32, float32 activations
    want = fused_experts_ref(x.float(), q13.float() * s13[:, :, None], q2.float() * s2[:, :, None], weights, ids)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    # the scales are applied: the float8 rows alone give a different answer
    assert not torch.allclose(fused_experts(x, q13, q2, weights, ids, w13_scale=torch.ones_like(s13),
                                            w2_scale=torch.ones_like(s2)).float(), want, atol=tol, rtol=tol)


def _packed_experts_on_gpu(bits, group, act_order, dtype):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "layers"))
    from test_moe_packed_experts import _experts

    from pagedllm.kernels.moe.grouped_gemm import PackedExpertWeights

    # A Qwen3-30B-A3B layer, narrowed: 128 experts of 512 x 192, top-8.
    w13, w2, dense13, dense2 = _experts(128, 512, 192, bits, group, act_order, dtype, seed=bits)
    move = lambda w: PackedExpertWeights(**{**w.__dict__, **{k: getattr(w, k).to(DEVICE) for k in  # noqa: E731
                                            ("qweight", "scales", "zeros", "g_idx") if getattr(w, k) is not None}})
    return move(w13), move(w2), dense13.to(DEVICE), dense2.to(DEVICE)


@pytest.mark.parametrize("tokens", [1, 16, 256, 4096])
@pytest.mark.parametrize("bits,group,act_order", [(4, 64, False), (4, 32, True), (8, 64, False)])
def test_packed_experts_match_their_dequantized_reference(tokens, bits, group, act_order):
    dtype = torch.bfloat16
    w13, w2, dense13, dense2 = _packed_experts_on_gpu(bits, group, act_order, dtype)
    x, _, _, weights, ids = _case(tokens, 128, 8, 512, 192, dtype, seed=2)
    got = fused_experts(x, w13, w2, weights, ids)
    want = fused_experts_ref(x.float(), dense13.float(), dense2.float(), weights, ids)
    # bf16 outputs and intermediate activations against float32: within a few bf16 roundings of the largest output.
    torch.testing.assert_close(got.float(), want, atol=3e-2 * want.abs().max().item(), rtol=3e-2)


@pytest.mark.parametrize("tokens", [1, 16, 256, 4096])
def test_block_fp8_experts_match_the_per_expert_linears(tokens):
    """Block-wise float8 experts (128 x 128 blocks) in the grouped kernel against the per-expert loop of the dense
    block-float8 product (``kernels/fp8_block.py``): the same float8 activation groups and blocks, other sums."""
    from pagedllm.kernels.fp8_block import fp8_block_linear
    from pagedllm.kernels.moe.grouped_gemm import BlockFp8ExpertWeights
    from pagedllm.layers.fused_moe.reference import gated_activation, per_expert

    x, w13, w2, weights, ids = _case(tokens, 64, 8, 512, 256, torch.bfloat16, seed=3)
    g = torch.Generator(device=DEVICE).manual_seed(4)
    q13, q2 = (w13.float() * 200).clamp(-448, 448).to(torch.float8_e4m3fn), (w2.float() * 200).clamp(-448, 448).to(
        torch.float8_e4m3fn)
    s13 = torch.rand(64, 512 // 128, 512 // 128, generator=g, device=DEVICE) * 1e-2 + 1e-3
    s2 = torch.rand(64, 512 // 128, 256 // 128, generator=g, device=DEVICE) * 1e-2 + 1e-3
    got = fused_experts(x, BlockFp8ExpertWeights(q13, s13, (128, 128)), BlockFp8ExpertWeights(q2, s2, (128, 128)),
                        weights, ids)

    def expert(rows: torch.Tensor, e: int) -> torch.Tensor:
        h = gated_activation(fp8_block_linear(rows, q13[e], s13[e], (128, 128), 128), "silu")
        return fp8_block_linear(h, q2[e], s2[e], (128, 128), 128)

    want = per_expert(x, weights, ids, 64, expert)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2 * want.abs().max().item(), rtol=3e-2)


@pytest.mark.parametrize("tokens,symmetric", [(1, True), (16, True), (256, True), (4096, True), (1, False),
                                              (256, False)])
def test_int8_experts_match_the_per_expert_w8a8_products(tokens, symmetric):
    """W8A8 experts in the grouped kernel against the per-expert loop of the dense W8A8 product (``w8a8_linear``:
    the decode kernel up to 16 rows, cuBLAS's int8 product past that): the same int8 rows and exact int32 sums;
    asymmetric activations take a zero point per token (the torch quantizer, then cuBLAS)."""
    from pagedllm.kernels.moe.grouped_gemm import Int8ExpertWeights
    from pagedllm.layers.fused_moe.reference import gated_activation, per_expert
    from pagedllm.layers.quantization.int8 import quantize_int8_rows, w8a8_linear

    x, w13, w2, weights, ids = _case(tokens, 64, 8, 512, 256, torch.bfloat16, seed=5)
    (q13, s13, _), (q2, s2, _) = quantize_int8_rows(w13.flatten(0, 1)), quantize_int8_rows(w2.flatten(0, 1))
    make = Int8ExpertWeights if symmetric else Int8ExpertWeights.asymmetric
    e13 = make(q13.view(w13.shape), s13.view(w13.shape[:2]))
    e2 = make(q2.view(w2.shape), s2.view(w2.shape[:2]))
    got = fused_experts(x, e13, e2, weights, ids)

    def expert(rows: torch.Tensor, e: int) -> torch.Tensor:
        h = gated_activation(w8a8_linear(rows, e13.weight[e], e13.scale[e][:, None], None, symmetric), "silu")
        return w8a8_linear(h, e2.weight[e], e2.scale[e][:, None], None, symmetric)

    want = per_expert(x, weights, ids, 64, expert)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2 * want.abs().max().item(), rtol=1e-2)


def test_fp8_layer_takes_the_kernel_and_replays_in_a_graph():
    torch.manual_seed(0)
    moe = MoEExperts(16, 2, 256, 128, renormalize=True, params_dtype=torch.bfloat16).to(DEVICE)
    moe.w13_weight.normal_(std=0.05)
    moe.w2_weight.normal_(std=0.05)
    moe.quantize_fp8()
    assert moe.w13_weight.dtype == torch.float8_e4m3fn and moe.w13_weight_scale.device.type == "cuda"
    x = torch.randn(64, 256, device=DEVICE, dtype=torch.bfloat16)
    logits = torch.randn(64, 16, device=DEVICE)
    eager = moe(x, logits)
    weights, ids = select_experts(logits, 2, True)
    assert torch.equal(eager, fused_experts(x, moe.w13_weight, moe.w2_weight, weights, ids,
                                            w13_scale=moe.w13_weight_scale, w2_scale=moe.w2_weight_scale))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe(x, logits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe(x, logits)
    logits.copy_(torch.randn(64, 16, device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, moe(x, logits))


def test_layer_takes_the_kernel_and_replays_in_a_graph():
    torch.manual_seed(0)
    moe = MoEExperts(16, 2, 256, 128, renormalize=True, params_dtype=torch.bfloat16).to(DEVICE)
    moe.w13_weight.normal_(std=0.05)
    moe.w2_weight.normal_(std=0.05)
    x = torch.randn(64, 256, device=DEVICE, dtype=torch.bfloat16)
    logits = torch.randn(64, 16, device=DEVICE)
    eager = moe(x, logits)
    weights, ids = select_experts(logits, 2, True)
    assert torch.equal(eager, fused_experts(x, moe.w13_weight, moe.w2_weight, weights, ids))
    # No host synchronisation inside: the whole layer captures into a graph.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe(x, logits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe(x, logits)
    logits.copy_(torch.randn(64, 16, device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, moe(x, logits))


def test_moe_model_greedy_matches_cpu(tmp_path):
    from pagedllm import LLM, SamplingParams

    path = make_tiny_model("qwen3_moe", tmp_path / "qwen3_moe")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(model=path, dtype="float32", device=device, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
        outs[device] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert outs["cuda"] == outs["cpu"]


def test_fp8_moe_model_greedy_matches_dequantized_experts(tmp_path):
    """bf16 activations over float8 experts (--quantization fp8) on the GPU give the tokens of the same
    experts dequantized to bf16 and run through the 16-bit kernel (float8 weight tiles and epilogue scales
    against plain bf16 tiles)."""
    from pagedllm import LLM, SamplingParams

    path = make_tiny_model("mixtral", tmp_path / "mixtral")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(model=path, dtype="bfloat16", device="cuda", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24,
              quantization="fp8", enforce_eager=True)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    experts = [m for m in model.modules() if isinstance(m, MoEExperts)]
    assert experts and all(m.w13_weight.dtype == torch.float8_e4m3fn for m in experts)
    for m in experts:
        # Power-of-two scales: each float8 weight times its scale is exact in bf16, and scaling the float32 sums
        # commutes with their rounding, so both paths below compute the same numbers bit for bit.
        m.w13_weight_scale = torch.exp2(torch.round(torch.log2(m.w13_weight_scale)))
        m.w2_weight_scale = torch.exp2(torch.round(torch.log2(m.w2_weight_scale)))
    fp8_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for m in experts:
        for name in ("w13_weight", "w2_weight"):
            deq = getattr(m, name).float() * getattr(m, name + "_scale")[:, :, None]
            setattr(m, name, torch.nn.Parameter(deq.bfloat16(), requires_grad=False))
            setattr(m, name + "_scale", None)
    deq_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert deq_tokens == fp8_tokens


@pytest.mark.parametrize("fmt,tol", [("awq", 4e-2), ("gptq-act-order", 4e-2), ("ct-w8a8", 6e-2)])
def test_quantized_experts_on_the_gpu_follow_their_dequantized_model(fmt, tol, tmp_path):
    """A Mixtral checkpoint with quantized experts in float16 against the same model dequantized. 4-bit and W8A8
    experts are stacked for the grouped kernel and the steps replay in CUDA graphs. Greedy tokens agree up to a
    near-tie of the reference (float16 products summed in other orders; int8 activations' rounding)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models"))
    from test_quantized_moe import _quantized_pair, assert_follows

    from pagedllm import LLM, SamplingParams

    ckpt, ref = _quantized_pair("mixtral", fmt, tmp_path)
    prompts = [list(range(3, 20)), list(range(40, 71))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)

    def run(path: str):
        llm = LLM(model=path, dtype="float16", device="cuda", skip_tokenizer_init=True, max_model_len=128,
                  gpu_memory_utilization=0.1)
        try:
            runner = llm.llm_engine.engine_core.executor.worker.model_runner
            graphs = runner.use_cuda_graphs
            if path == ckpt:
                moe = [m for m in runner.model.modules() if isinstance(m, MoEExperts)]
                assert moe and all(m.w13_packed is not None for m in moe)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        return graphs, [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].logprobs for o in outs]

    graphs, tokens, lps = run(ckpt)
    ref_graphs, ref_tokens, ref_lps = run(ref)
    assert graphs and ref_graphs
    assert_follows(tokens, lps, ref_tokens, ref_lps, tie=tol, tol=tol)
