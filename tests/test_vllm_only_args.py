"""vLLM engine arguments with no counterpart here (vllm_only_args.py): accepted at values that change
nothing, from Python and from the command line; refused by name, before anything loads, otherwise."""
from __future__ import annotations

import logging

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine_args import EngineArgs
from pagedllm.entrypoints.cli.main import _build_parser
from pagedllm.vllm_only_args import pop_vllm_only_args
from tiny_models import make_tiny_model


def test_a_vllm_script_s_options_start_the_engine_unchanged(tmp_path, caplog):
    path = make_tiny_model("llama", tmp_path / "llama")
    common = dict(model=path, skip_tokenizer_init=True, device="cpu", dtype="float32", max_model_len=64, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    prompt = {"prompt_token_ids": [5, 9, 13, 2]}
    expected = LLM(**common).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(**common, disable_log_stats=True, swap_space=4, revision="main", tokenizer_mode="auto",
                  max_seq_len_to_capture=8192, distributed_executor_backend="uni", enable_lora=False, task="generate")
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert "disable_log_stats=True" in caplog.text and "swap_space=4" in caplog.text


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"enable_lora": True}, "enable_lora=True is not supported"),
    ({"cpu_offload_gb": 8}, "cpu_offload_gb=8"),
    ({"tokenizer_mode": "mistral"}, "tokenizer_mode='mistral' is not supported by pagedllm; it takes 'auto'"),
    ({"swap_space": -1}, "swap_space=-1"),
    ({"revision": "v2"}, "revision='v2'"),
])
def test_values_that_would_need_a_missing_feature_are_refused_before_loading(kwargs, message):
    # The model path does not exist: the error comes first.
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        LLM(model="/nonexistent/model", **kwargs)


def test_unknown_arguments_stay_errors():
    kwargs = {"disable_log_stats": True, "not_an_option": 1}
    pop_vllm_only_args(kwargs)
    assert kwargs == {"not_an_option": 1}
    with pytest.raises(TypeError, match="not_an_option"):
        LLM(model="/nonexistent/model", not_an_option=1)


def test_a_vllm_command_line_parses():
    parser = _build_parser()
    args = parser.parse_args(["serve", "m", "--disable-log-stats", "--disable-log-requests", "--swap-space", "4",
                              "-pp", "1", "--max-seq-len-to-capture", "8192", "--tokenizer-mode", "auto"])
    EngineArgs.from_cli_args(args)  # accepted
    args = parser.parse_args(["bench", "throughput", "--model", "m", "--cpu-offload-gb", "2"])
    with pytest.raises(ValueError, match="cpu_offload_gb=2"):
        EngineArgs.from_cli_args(args)
