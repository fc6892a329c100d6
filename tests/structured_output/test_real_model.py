"""Structured outputs on the real default model (Gemma 3 270M, GGUF; 262k-token vocabulary), on the CPU."""
from __future__ import annotations

import pytest
import torch
from json_schemas import assert_valid, schemas

from pagedllm import LLM, SamplingParams, StructuredOutputsParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "<start_of_turn>user\nDescribe a small test record as JSON.<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def gemma():
    from pagedllm.model_loader.default_model import default_model_path

    try:
        path = default_model_path()
    except RuntimeError as e:  # the model package is not installed
        pytest.skip(str(e))
    threads = torch.get_num_threads()
    # One thread: two OpenMP threads on a shared 2-core machine spin-wait on each other.
    torch.set_num_threads(1)
    yield LLM(model=path, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory_bytes=1 << 26)
    torch.set_num_threads(threads)


def _check(outs, wanted, n: int = 1) -> None:
    for schema, out in zip(wanted, outs, strict=True):
        assert len(out.outputs) == n
        for c in out.outputs:
            assert c.finish_reason == "stop", (schema, c.text, c.finish_reason, c.stop_reason)
            assert_valid(c.text, schema)


def test_fifty_schemas_greedy_and_sampled(gemma):
    chosen = schemas(52, seed=1)
    greedy = [SamplingParams(temperature=0.0, max_tokens=160,
                             structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True))
              for s in chosen]
    _check(gemma.generate([PROMPT] * len(chosen), greedy, use_tqdm=False), chosen)
    sampled_schemas = chosen[::6]
    sampled = [SamplingParams(temperature=1.0, seed=i, n=4, max_tokens=160,
                              structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True))
               for i, s in enumerate(sampled_schemas)]
    _check(gemma.generate([PROMPT] * len(sampled_schemas), sampled, use_tqdm=False), sampled_schemas, n=4)


def test_whitespace_allowed_regex_choice(gemma):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"]}
    outs = gemma.generate(
        [PROMPT] * 3,
        [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=schema)),
         SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r"\d{3}-[A-Z]{2}")),
         SamplingParams(temperature=1.0, seed=0, n=4, max_tokens=20,
                        structured_outputs=StructuredOutputsParams(choice=["cat", "dog", "bird"]))],
        use_tqdm=False,
    )
    js, rx, ch = (o.outputs for o in outs)
    assert js[0].finish_reason == "stop"
    assert_valid(js[0].text, schema)
    assert rx[0].finish_reason == "stop" and len(rx[0].text) == 6 and rx[0].text[3] == "-"
    assert all(c.finish_reason == "stop" and c.text in ("cat", "dog", "bird") for c in ch)
