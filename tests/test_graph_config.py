"""vLLM's compilation_config, as far as it applies: the CUDA graphs the runner captures (graph_config.py)."""
from __future__ import annotations

import logging

import pytest

from pagedllm.graph_config import GraphConfig, parse_compilation_config
from pagedllm.worker.cuda_graphs import capture_sizes, graph_sizes, token_capture_sizes


def test_default_is_the_runners_own_buckets():
    gc = parse_compilation_config(None)
    assert gc == GraphConfig()
    assert graph_sizes(gc, 256, 8192) == (token_capture_sizes(8192), capture_sizes(256))
    assert capture_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_capture_sizes_pick_the_decode_graphs_up_to_max_num_seqs():
    # Given unsorted, with a repeat and a size above max_num_seqs (dropped: such batches run eagerly).
    gc = parse_compilation_config({"cudagraph_capture_sizes": [8, 1, 24, 16, 8, 512]})
    assert gc.decode_sizes == (1, 8, 16, 24, 512)
    assert graph_sizes(gc, 256, 8192) == (token_capture_sizes(8192), [1, 8, 16, 24])
    # The same as JSON text, as `--compilation-config` / `-O` pass it.
    assert parse_compilation_config('{"cudagraph_capture_sizes": [8, 1, 24, 16, 8, 512]}') == gc


def test_max_capture_size_caps_the_default_and_the_given_sizes():
    assert graph_sizes(parse_compilation_config({"max_cudagraph_capture_size": 48}), 256, 8192)[1] == [1, 2, 4, 8, 16, 32]
    gc = parse_compilation_config({"cudagraph_capture_sizes": [1, 40, 80], "max_cudagraph_capture_size": 64})
    assert graph_sizes(gc, 256, 8192)[1] == [1, 40]
    assert graph_sizes(parse_compilation_config({"max_cudagraph_capture_size": 0}), 256, 8192)[1] == []


@pytest.mark.parametrize(("mode", "decode", "mixed"), [
    ("NONE", False, False), ("FULL_DECODE_ONLY", True, False), ("full", True, True), ("PIECEWISE", True, True),
    ("FULL_AND_PIECEWISE", True, True),
])
def test_cudagraph_mode(mode, decode, mixed):
    gc = parse_compilation_config({"cudagraph_mode": mode})
    assert (gc.decode_graphs, gc.mixed_graphs) == (decode, mixed)
    got_mixed, got_decode = graph_sizes(gc, 4, 40)
    assert bool(got_decode) == decode and bool(got_mixed) == mixed


def test_levels_and_torch_compile_keys_are_accepted_without_effect(caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert parse_compilation_config(3) == GraphConfig()
        assert parse_compilation_config("3") == GraphConfig()
        gc = parse_compilation_config({"level": 3, "use_inductor": False, "custom_ops": ["none"],
                                       "cudagraph_capture_sizes": [4]})
    assert gc.decode_sizes == (4,)
    assert "custom_ops, level, use_inductor" in caplog.text


@pytest.mark.parametrize(("value", "message"), [
    ({"cudagraph_capture_size": [1]}, "key 'cudagraph_capture_size' is unknown"),
    ({"cudagraph_capture_sizes": [1, 0]}, "holds 0; sizes must be >= 1"),
    ({"cudagraph_capture_sizes": 8}, "must be a list of ints; got 8"),
    ({"cudagraph_capture_sizes": [1, "2"]}, "must be a list of ints"),
    ({"max_cudagraph_capture_size": -1}, "must be an int >= 0; got -1"),
    ({"cudagraph_mode": "FAST"}, "cudagraph_mode 'FAST' is not one of NONE"),
    ("{not json", "neither an integer level nor JSON"),
    ([1, 2], "must be an int level, a dict or its JSON text"),
])
def test_bad_values_name_the_field_and_the_value(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_compilation_config(value)


def test_engine_args_take_it_from_python_and_the_command_line():
    from pagedllm.engine_args import EngineArgs
    from pagedllm.entrypoints.cli.main import _build_parser

    parser = _build_parser()
    args = parser.parse_args(["serve", "m", "-O", '{"cudagraph_capture_sizes": [1, 2, 4]}'])
    assert EngineArgs.from_cli_args(args).compilation_config == '{"cudagraph_capture_sizes": [1, 2, 4]}'
    args = parser.parse_args(["bench", "throughput", "--model", "m", "--compilation-config", '{"cudagraph_mode": "NONE"}'])
    assert parse_compilation_config(EngineArgs.from_cli_args(args).compilation_config).decode_graphs is False
    # Checked before anything is loaded: the model path need not exist.
    with pytest.raises(ValueError, match="unknown"):
        EngineArgs(model="/nonexistent", compilation_config={"cudagraph_sizes": [1]}).create_engine_config()
