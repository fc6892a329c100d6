"""Start-up checks of the parallel sizes: errors that name the numbers, before any weight is read."""
from __future__ import annotations

import os

import pytest
from tiny_models import make_tiny_model

from pagedllm import LLM
from pagedllm.engine_args import EngineArgs
from pagedllm.entrypoints.cli.main import _build_parser


@pytest.fixture
def garbage_weights(tmp_path):
    """A tiny model whose weights file is garbage: any check that lets loading start fails otherwise."""
    path = make_tiny_model("llama", tmp_path / "llama", num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(b"not a checkpoint")
    return path


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"tensor_parallel_size": 3}, ValueError, "4 attention heads are not divisible by tensor_parallel_size 3"),
    ({"tensor_parallel_size": 8}, ValueError, "4 attention heads are not divisible by tensor_parallel_size 8"),
    ({"pipeline_parallel_size": 4}, ValueError, "3 layers are fewer than pipeline_parallel_size 4"),
    ({"tensor_parallel_size": 0}, ValueError, "tensor_parallel_size must be an integer >= 1, got 0"),
    ({"pipeline_parallel_size": 2, "distributed_executor_backend": "uni"}, ValueError,
     "'uni' runs one worker, but tensor_parallel_size 1 x pipeline_parallel_size 2 = 2 ranks"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "dask"}, ValueError,
     "distributed_executor_backend must be one of uni, mp, ray or None; got 'dask'"),
    ({"tensor_parallel_size": 2, "async_scheduling": True}, NotImplementedError,
     "async_scheduling with tensor_parallel_size 2 x pipeline_parallel_size 1"),
])
def test_bad_sizes_are_named_before_any_weight_loads(garbage_weights, kwargs, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(")):
        LLM(model=garbage_weights, device="cpu", skip_tokenizer_init=True, **kwargs)


def test_kv_heads_that_ranks_cannot_share_are_named(tmp_path):
    path = make_tiny_model("llama", tmp_path / "llama", num_attention_heads=4, num_key_value_heads=4)
    with pytest.raises(ValueError, match="tensor_parallel_size 8 is not a multiple|4 attention heads"):
        LLM(model=path, device="cpu", skip_tokenizer_init=True, tensor_parallel_size=8)
    path = make_tiny_model("llama", tmp_path / "odd", hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match="the model's 3 KV heads are not divisible by tensor_parallel_size 2"):
        LLM(model=path, device="cpu", skip_tokenizer_init=True, tensor_parallel_size=2)


def test_vllm_s_flags_parse():
    args = _build_parser().parse_args(["serve", "m", "-tp", "2", "-pp", "3", "--distributed-executor-backend", "mp"])
    ea = EngineArgs.from_cli_args(args)
    assert (ea.tensor_parallel_size, ea.pipeline_parallel_size, ea.distributed_executor_backend) == (2, 3, "mp")
    args = _build_parser().parse_args(["generate", "--model", "m", "--tensor-parallel-size", "4",
                                       "--pipeline-parallel-size", "2", "hi"])
    ea = EngineArgs.from_cli_args(args)
    assert (ea.tensor_parallel_size, ea.pipeline_parallel_size, ea.distributed_executor_backend) == (4, 2, None)
