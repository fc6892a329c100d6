"""Mixture-of-experts checkpoints quantized per expert (AWQ, GPTQ with act-order, compressed-tensors W4A16 and W8A8,
block-wise float8): their experts load as one quantized linear each (``layers/fused_moe/linear_experts.py``) and
give, in float32, the greedy tokens and logprobs of the same model with every quantized weight dequantized (up to
the activations' rounding where the format quantizes them); under tensor and expert parallelism (gloo) the tokens
of one process."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "distributed"))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import quant_checkpoints as qc  # noqa: E402

GROUP = 32  # divides the tiny models' hidden (64) and expert (32) sizes
# Projections that the formats quantize: attention, the dense MLP and every expert's (not the routers).
_QUANTIZED = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"}
_PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


def _awq(w: torch.Tensor) -> tuple[dict, torch.Tensor]:  # [N, K] -> AutoAWQ tensors, dequantized [N, K]
    n, k = w.shape
    wg = w.reshape(n, k // GROUP, GROUP)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    s = scales.float()
    zeros = torch.clamp(-torch.round(lo / s), 0, 15)
    q = torch.clamp(torch.round(wg / s[..., None]) + zeros[..., None], 0, 15)
    deq = ((q - zeros[..., None]) * s[..., None]).reshape(n, k)
    return {"qweight": qc._pack_awq(q.reshape(n, k).t().to(torch.int32)),
            "qzeros": qc._pack_awq(zeros.t().to(torch.int32)), "scales": scales.t().contiguous()}, deq


# Projections that read one input share GPTQ's input order (its Hessian's), as fused layers require.
_SAME_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj", "w3": "w1"}


def _gptq_act_order(w: torch.Tensor, order: torch.Tensor) -> tuple[dict, torch.Tensor]:
    k = w.shape[1]
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // GROUP).to(torch.int32)
    q, zeros, scales, deq = qc.gptq_quantize(w, 4, GROUP, False, g_idx, min_zero=1)
    return {"qweight": qc._pack_rows(q, 4), "qzeros": qc._pack_rows((zeros - 1).t().contiguous() & 15, 4).t(),
            "scales": scales, "g_idx": g_idx}, deq


def _ct_w4a16(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """compressed-tensors pack-quantized, symmetric groups: values offset by 8, packed along the inputs."""
    n, k = w.shape
    wg = w.reshape(n, k // GROUP, GROUP)
    scale = (wg.abs().amax(-1) / 7.5).clamp(min=1e-6)  # [N, G]
    q = torch.clamp(torch.round(wg / scale[..., None]), -8, 7)
    deq = (q * scale[..., None]).reshape(n, k)
    packed = qc._pack_rows((q.reshape(n, k) + 8).t().to(torch.int32), 4).t().contiguous()  # [N, K / 8]
    return {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor([n, k])}, deq


def _fp8_blocks(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """vLLM's ``fp8`` layout with ``weight_block_size`` (DeepSeek/Qwen3-FP8): e4m3 weights, a scale a block."""
    n, k = w.shape
    wb = w.reshape(n // GROUP, GROUP, k // GROUP, GROUP)
    scale = (wb.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)  # [N / b, K / b]
    q = (wb / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return {"weight": q.reshape(n, k), "weight_scale_inv": scale}, (q.float() * scale[:, None, :, None]).reshape(n, k)


def _int8_rows(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """compressed-tensors int-quantized weights: int8 rows, symmetric, a scale a row."""
    scale = (w.abs().amax(-1, keepdim=True) / 127.5).clamp(min=1e-8)  # [N, 1]
    q = torch.clamp(torch.round(w / scale), -128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


_FORMATS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
    "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
                       "checkpoint_format": "gptq"},
    "ct-w4a16": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                     "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}}},
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [GROUP, GROUP]},
    "ct-w8a8": {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                          "dynamic": True}}}},
}
_FORMATS["ct-w8a8-asym-act"] = json.loads(json.dumps(_FORMATS["ct-w8a8"]).replace('"symmetric": true, "strategy": "token"',
                                                                                  '"symmetric": false, "strategy": "token"'))
_QUANTIZERS = {"awq": _awq, "ct-w4a16": _ct_w4a16, "fp8-block": _fp8_blocks, "ct-w8a8": _int8_rows,
               "ct-w8a8-asym-act": _int8_rows}


def _quantized_pair(kind: str, fmt: str, root, **shape) -> tuple[str, str]:
    """(checkpoint, reference) directories: a tiny ``kind`` model (``shape``: config fields over its own) with every
    quantized projection (experts included) stored in ``fmt``, and the same model with those weights dequantized."""
    base = make_tiny_model(kind, root / "base", **shape)
    state = load_file(os.path.join(base, "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    orders: dict[str, torch.Tensor] = {}
    tensors, ref = {}, {}
    for name, t in state.items():
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if leaf == "weight" and t.dim() == 2 and proj in _QUANTIZED:
            if fmt.startswith("gptq"):
                order = orders.setdefault(f"{parent}.{_SAME_INPUT.get(proj, proj)}",
                                          torch.randperm(t.shape[1], generator=gen))
                parts, deq = _gptq_act_order(t.float(), order)
            else:
                parts, deq = _QUANTIZERS[fmt](t.float())
            tensors.update({f"{module}.{k}": v for k, v in parts.items()})
            ref[name] = deq
        else:
            tensors[name] = ref[name] = t
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f)
    out = []
    for sub, tens, qcfg in (("q", tensors, _FORMATS[fmt]), ("ref", ref, None)):
        dst = root / sub
        dst.mkdir()
        save_file({k: v.contiguous() for k, v in tens.items()}, str(dst / "model.safetensors"))
        (dst / "config.json").write_text(json.dumps(dict(config, quantization_config=qcfg) if qcfg else config))
        out.append(str(dst))
    return out[0], out[1]


def _run(path: str, prompts: list[list[int]], **kw):
    llm = LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=128, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _PARAMS, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].logprobs for o in outs]


def assert_follows(tokens, lps, want_tokens, want_lps, tie: float, tol: float) -> None:
    """Each greedy path holds the reference's logprobs within ``tol`` until it parts from it, and parts only at a
    near-tie of the reference (its runner-up within ``tie`` of its choice)."""
    for ours, theirs, our_lp, their_lp in zip(tokens, want_tokens, lps, want_lps):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if a != b:
                assert a in their_lp[i] and their_lp[i][b].logprob - their_lp[i][a].logprob < tie, (i, a, b)
                break
            assert abs(our_lp[i][a].logprob - their_lp[i][b].logprob) < tol, (i, a)


@pytest.mark.parametrize("kind,fmt", [("mixtral", "awq"), ("qwen3_moe", "gptq-act-order"), ("mixtral", "ct-w4a16"),
                                      ("qwen2_moe", "gptq-act-order")])
def test_quantized_experts_equal_their_dequantized_model(kind, fmt, tmp_path):
    # Qwen2-MoE: a dense first layer and a shared expert (quantized too), 64 rows wide for whole groups.
    shape = {"shared_expert_intermediate_size": 64} if kind == "qwen2_moe" else {}
    ckpt, ref = _quantized_pair(kind, fmt, tmp_path, **shape)
    prompts = [list(range(3, 20)), list(range(40, 71)), [5]]
    tokens, lps = _run(ckpt, prompts)
    want_tokens, want_lps = _run(ref, prompts)
    assert tokens == want_tokens
    for ours, theirs in zip(lps, want_lps):
        for a, b in zip(ours, theirs):
            assert a.keys() == b.keys()
            for t in a:
                assert abs(a[t].logprob - b[t].logprob) < 1e-4


@pytest.mark.parametrize("kind,fmt", [("qwen3_moe", "fp8-block"), ("mixtral", "ct-w8a8")])
def test_experts_with_quantized_activations_follow_their_dequantized_model(kind, fmt, tmp_path):
    """Block-wise float8 and W8A8 also quantize each product's activations (float8 a scale per 32 inputs, int8
    a scale per token), so the outputs differ from the dequantized model's by that rounding: logprobs within 5e-2
    until the greedy paths part, and they may part only where the reference's top two are that close."""
    ckpt, ref = _quantized_pair(kind, fmt, tmp_path)
    prompts = [list(range(3, 20)), list(range(40, 71)), [5]]
    tokens, lps = _run(ckpt, prompts)
    want_tokens, want_lps = _run(ref, prompts)
    assert_follows(tokens, lps, want_tokens, want_lps, tie=5e-2, tol=5e-2)


def test_quantized_experts_are_linears_of_the_checkpoint_method(tmp_path):
    from pagedllm.layers.fused_moe import MoEExperts
    from pagedllm.layers.quantization.gptq import GPTQLinearMethod

    ckpt, _ = _quantized_pair("qwen3_moe", "gptq-act-order", tmp_path)
    llm = LLM(model=ckpt, dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=64)
    try:
        model = llm.llm_engine.engine_core.executor.worker.model_runner.model
        moe = [m for m in model.modules() if isinstance(m, MoEExperts)]
        assert moe and all(len(m.linear_experts) == m.num_experts == 16 for m in moe)
        expert = moe[0].linear_experts[5]
        assert all(isinstance(getattr(expert, p).quant_method, GPTQLinearMethod) for p in ("w1", "w2", "w3"))
    finally:
        llm.llm_engine.shutdown()


def test_quantized_experts_under_tensor_and_expert_parallelism(tmp_path):
    """Act-order groups split over two ranks' rows of each expert's down projection (TP), and whole experts per
    rank, the loader skipping the other rank's (EP)."""
    from parallel_cases import generate, prompts

    # Experts of 128 rows: each rank's half of a down projection holds two groups of 32.
    ckpt, _ = _quantized_pair("mixtral", "gptq-act-order", tmp_path, intermediate_size=128)
    ids = prompts(vocab=256)
    one = generate(ckpt, ids)
    assert generate(ckpt, ids, tensor_parallel_size=2) == one
    assert generate(ckpt, ids, tensor_parallel_size=2, enable_expert_parallel=True) == one


# compressed-tensors W4A16 reaches the same common layout as AWQ (test_quantized_experts_equal_their_dequantized_model
# covers its conversion), so AWQ stands for both here.
# The W8A8 case takes activations with a zero point per token, the grouped kernel's longer int8 epilogue; the
# symmetric one differs only in that epilogue (tests/layers/test_moe_int8_experts.py has both).
@pytest.mark.parametrize("kind,fmt", [("mixtral", "awq"), ("qwen3_moe", "gptq-act-order"), ("qwen3_moe", "fp8-block"),
                                      ("mixtral", "ct-w8a8-asym-act")])
def test_experts_restacked_for_the_grouped_kernel_keep_their_tokens(kind, fmt, tmp_path, monkeypatch):
    """What a CUDA load does to 4-bit, block-float8 and W8A8 experts, done on the CPU under Triton's interpreter:
    4-bit expert linears to the kernel layout (the CPU's own rows, where its kernel took them), then each layer's experts stacked for the grouped kernel (act-order
    rows back in checkpoint order with a group index per row; float8 and int8 weights with their scales); the
    model keeps its tokens and logprobs (float32, within 1e-4) and may replay in CUDA graphs."""
    from pagedllm.kernels import fp8_block
    from pagedllm.layers.fused_moe import MoEExperts
    from pagedllm.layers.quantization.fp8_block import quantize_groups_ref

    # The interpreter rounds float32 to float8 unlike the GPU next to powers of two (tests/gpu checks the
    # activation quantizer bit for bit there): here the products' inputs are rounded as the linears round them.
    monkeypatch.setattr(fp8_block, "quantize_groups", quantize_groups_ref)
    ckpt, _ = _quantized_pair(kind, fmt, tmp_path)
    prompts = [list(range(3, 20)), [5]]
    llm = LLM(model=ckpt, dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=64)
    try:
        run = lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], _PARAMS, use_tqdm=False)  # noqa: E731
        want = run()
        moe = [m for m in llm.llm_engine.engine_core.executor.worker.model_runner.model.modules()
               if isinstance(m, MoEExperts)]
        for layer in moe:
            if fmt in ("awq", "gptq-act-order"):
                for expert in layer.linear_experts:
                    for proj in (expert.w1, expert.w3, expert.w2):
                        if not hasattr(proj, "wna16"):  # rows for the CPU's kernel are restacked as they are
                            proj.quant_method.to_kernel_layout(proj)
            assert layer.experts_method.stack_for_kernel(layer)
            assert layer.linear_experts is None and layer.experts_method.cuda_graph_safe
            assert layer.w13_packed.shape == (layer.num_experts, 2 * layer.intermediate_size_per_partition,
                                              layer.hidden_size)
        got = run()
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for ours, theirs in zip(got, want):
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
