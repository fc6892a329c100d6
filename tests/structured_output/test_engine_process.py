"""Structured outputs through AsyncLLM: the constraint crosses the msgpack wire to the engine-core process,
which loads the tokenizer itself, compiles there and streams the constrained deltas back."""
from __future__ import annotations

import asyncio

import pytest
from json_schemas import assert_valid
from tiny_models import make_tiny_model_with_tokenizer

from pagedllm import EngineArgs, SamplingParams, StructuredOutputsParams
from pagedllm.engine.async_llm import AsyncLLM

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                   "next": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 3}]}},
    "required": ["id", "tags", "next"],
}


async def _collect(engine: AsyncLLM, rid: str, prompt: str, params: SamplingParams) -> dict[int, tuple[str, str]]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    async for out in engine.generate(prompt, params, rid):
        for c in out.outputs:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return {i: (texts[i], reasons.get(i)) for i in texts}


def test_constraints_cross_to_the_core_process(tmp_path):
    path = make_tiny_model_with_tokenizer("qwen3", tmp_path / "m")
    args = EngineArgs(model=str(path), dtype="float32", device="cpu", max_model_len=256,
                      kv_cache_memory_bytes=1 << 24, async_scheduling=True)
    engine = AsyncLLM(args)

    async def run():
        so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        jobs = [
            _collect(engine, "json", "Data:", SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=80, structured_outputs=so)),
            _collect(engine, "choice", "Pick:", SamplingParams(temperature=0.0, max_tokens=10,
                                                              structured_outputs=StructuredOutputsParams(choice=["up", "down"]))),
            _collect(engine, "plain", "Hello", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)),
        ]
        results = await asyncio.gather(*jobs)
        # Refused in the front end, before anything is queued.
        with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
            engine.add_request("bad", "x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
        return results

    try:
        js, choice, plain = asyncio.run(run())
    finally:
        engine.shutdown()
    assert sorted(js) == [0, 1]
    for text, reason in js.values():
        assert reason == "stop"
        assert_valid(text, SCHEMA)
    assert choice[0][1] == "stop" and choice[0][0] in ("up", "down")
    assert plain[0][1] == "length"
