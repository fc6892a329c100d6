"""KV-cache scales from a checkpoint (``*.k_scale`` / ``*.v_scale`` / ``*.kv_scale``): they reach each attention layer,
a float8 cache holds ``k / k_scale`` and ``v / v_scale``, and the output is that of the unscaled cache."""
from __future__ import annotations

import os

import pytest
import torch
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.layers.attention import Attention
from pagedllm.layers.kv_scales import collect_kv_scales

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (9, 4)]


def _with_scales(src: str, dst: str, scales: dict[str, float]) -> str:
    """A copy of the checkpoint at ``src`` with one scalar tensor per layer for each suffix in ``scales``."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    for i in range(layers):
        for suffix, value in scales.items():
            state[f"model.layers.{i}.self_attn.{suffix}"] = torch.tensor(value)
    save_file(state, os.path.join(dst, "model.safetensors"))
    return dst


def _run(path: str, cache_dtype: str):
    llm = LLM(model=path, skip_tokenizer_init=True, device="cpu", dtype="float32", max_model_len=64,
              kv_cache_memory_bytes=1 << 20, kv_cache_dtype=cache_dtype, attention_backend="torch_ref")
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6, detokenize=False)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    attns = [m for m in runner.model.modules() if isinstance(m, Attention)]
    scales = [(a.k_scale, a.v_scale) for a in attns]
    cache0 = runner.kv_caches[0].float().clone()
    llm.llm_engine.engine_core.shutdown()
    return tokens, scales, cache0


def test_checkpoint_scales_reach_layers_and_scale_the_float8_cache(tmp_path):
    base = make_tiny_model("llama", tmp_path / "base")
    scaled = _with_scales(base, str(tmp_path / "scaled"), {"k_scale": 4.0, "v_scale": 0.5})
    tokens_ref, scales_ref, cache_ref = _run(base, "fp8")
    tokens, scales, cache = _run(scaled, "fp8")
    assert set(scales_ref) == {(1.0, 1.0)}
    assert set(scales) == {(4.0, 0.5)}
    # Layer 0's keys and values of the first prompt (its 9 slots of the first allocated block; the CPU cache
    # is not zero-filled, so only written slots are compared) do not depend on the cache: powers of two divide
    # float8 values exactly away from the subnormals, so the scaled cache times its scale is the unscaled one.
    ref_k, ref_v = cache_ref[0, 1, :9], cache_ref[1, 1, :9]
    big_k, big_v = ref_k.abs() > 0.1, ref_v.abs() > 0.1
    assert big_k.sum() > 50 and big_v.sum() > 50
    assert torch.equal((cache[0, 1, :9] * 4.0)[big_k], ref_k[big_k])
    assert torch.equal((cache[1, 1, :9] * 0.5)[big_v], ref_v[big_v])
    assert tokens == tokens_ref
    # Without a float8 cache the scales are not applied.
    _, scales_auto, _ = _run(scaled, "auto")
    assert set(scales_auto) == {(1.0, 1.0)}


def test_kv_scale_sets_both_and_holders_are_stripped():
    weights = [("model.layers.0.self_attn.kv_scale", torch.tensor(2.0)),
               ("model.layers.1.self_attn.k_proj.k_scale", torch.tensor([3.0])),
               ("model.layers.1.self_attn.v_proj.v_scale", torch.tensor(5.0)),
               ("model.layers.1.self_attn.k_proj.weight", torch.zeros(2, 2))]
    found: dict = {}
    rest = list(collect_kv_scales(weights, found))
    assert [n for n, _ in rest] == ["model.layers.1.self_attn.k_proj.weight"]
    assert found == {"model.layers.0.self_attn": {"k": 2.0, "v": 2.0}, "model.layers.1.self_attn": {"k": 3.0, "v": 5.0}}
    with pytest.raises(ValueError, match="k_scale.*-1.0.*positive"):
        list(collect_kv_scales([("a.k_scale", torch.tensor(-1.0))], {}))
