"""compressed-tensors checkpoints with online rotations (``transform_config``): which linears take them, under
tensor parallelism, and the checkpoints refused at load, naming what is wrong. Their greedy tokens against
compressed-tensors' own model are checked with the other formats (``test_quant_checkpoints.py``)."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("compressed_tensors")

import quant_checkpoints as qc  # noqa: E402
from test_quant_checkpoints import PROMPTS, _llm, pagedllm_greedy  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.layers.quantization.transforms import RotatedLinearMethod  # noqa: E402


def test_every_decoder_linear_is_rotated_and_the_lm_head_is_not() -> None:
    llm = _llm(qc.make_ct("ct-w8a8-quip"))
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    for layer in model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            method = linear.quant_method
            assert isinstance(method, RotatedLinearMethod)
            # QuIP rotates both sides; the fused projections rotate each of their outputs by their own matrix.
            assert method.rotate_input is not None and method.rotate_outputs is not None
            assert all(r is not None for _, r in method.rotate_outputs)
    assert not isinstance(getattr(model.lm_head, "quant_method", None), RotatedLinearMethod)
    # The layers share their group's matrices on the device, one copy each.
    first, last = model.model.layers[0], model.model.layers[-1]
    assert first.mlp.down_proj.quant_method.rotate_input is last.mlp.down_proj.quant_method.rotate_input
    assert first.self_attn.o_proj.quant_method.rotate_input is first.self_attn.qkv_proj.quant_method.rotate_input


def test_rotated_checkpoint_under_tp2_equals_one_process() -> None:
    # Blocks of 32 divide each rank's half of every input and output, so the rotations stay local to a rank.
    path = qc.make_ct("ct-w4a16-random-matrix")
    one = pagedllm_greedy(path)
    params = SamplingParams(temperature=0.0, max_tokens=len(one[0]), ignore_eos=True)
    llm = LLM(model=path, dtype="float32", device="cpu", max_model_len=128, skip_tokenizer_init=True,
              tensor_parallel_size=2)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == one


def _edited(tmp_path, src: str, edit_config=None, drop: tuple[str, ...] = ()) -> str:
    """A copy of checkpoint ``src`` with its quantization_config edited and tensors ``drop`` left out."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if edit_config is not None:
        edit_config(config["quantization_config"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in drop}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def _targets_lm_head(cfg: dict) -> None:
    for args in cfg["transform_config"]["config_groups"]["v"]["apply"]:
        args["ignore"] = []


def _only_q_proj(cfg: dict) -> None:
    for args in cfg["transform_config"]["config_groups"]["v"]["apply"]:
        args["targets"] = ["re:.*q_proj$"]


@pytest.mark.parametrize(("edit", "drop", "message"), [
    (_targets_lm_head, (), r"config_groups\['v'\] targets \['Linear'\].*ignore lm_head"),
    (None, ("model.layers.0.mlp.down_proj.v_input.weight",),
     r"holds no matrix for model\.layers\.0\.mlp\.down_proj \(group 'v', input, size 512\)"),
    (_only_q_proj, (), r"q_proj, .*k_proj, .*v_proj are fused into .*qkv_proj but their inputs are not rotated alike"),
])
def test_checkpoints_the_engine_cannot_rotate_as_stored_are_refused(tmp_path, edit, drop, message) -> None:
    path = _edited(tmp_path, qc.make_ct("ct-w8a8-quip"), edit, drop)
    with pytest.raises(ValueError, match=message):
        _llm(path)


def test_rotation_is_block_diagonal_and_divided_after_the_product() -> None:
    from pagedllm.layers.quantization.transforms import Rotation

    g = torch.Generator().manual_seed(0)
    block = torch.randint(0, 2, (4, 4), generator=g).double() * 2 - 1
    x = torch.randn(3, 8, generator=g)
    want = (x.double() @ torch.block_diag(block, block) / 2).float()
    assert torch.allclose(Rotation(block, 2.0)(x), want, atol=1e-6)
