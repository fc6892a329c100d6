"""Structured outputs end to end on a tiny random Llama with the Qwen3 tokenizer (CPU, offline LLM API).

A random model emits whatever the grammar allows, so every output here is shaped by the mask alone:
if a row were left unmasked, a parse or a schema check would fail.
"""
from __future__ import annotations

import json
import math
import re
import threading

import pytest
from json_schemas import assert_valid, schemas
from tiny_models import make_tiny_model_with_tokenizer

from pagedllm import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.timeout(300)


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 1 << 25)
    kwargs.setdefault("max_model_len", 512)
    return LLM(model=path, dtype="float32", device="cpu", **kwargs)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model_with_tokenizer("qwen3", tmp_path_factory.mktemp("so-qwen3"))


@pytest.fixture(scope="module")
def llm(model_path):
    return _llm(model_path)


def _json(schema: dict, **kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True, **kwargs)


def _check_all(outs, wanted_schemas, n: int = 1) -> None:
    for schema, out in zip(wanted_schemas, outs, strict=True):
        assert len(out.outputs) == n
        for c in out.outputs:
            assert c.finish_reason == "stop", (schema, c.text, c.finish_reason, c.stop_reason)
            assert_valid(c.text, schema)


SCHEMAS = schemas(60)


def test_sixty_schemas_greedy(llm):
    params = [SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=_json(s)) for s in SCHEMAS]
    _check_all(llm.generate(["Give me JSON:"] * len(SCHEMAS), params, use_tqdm=False), SCHEMAS)


def test_schemas_sampled_n4(llm):
    chosen = SCHEMAS[::4]
    params = [
        SamplingParams(temperature=1.0, seed=i, n=4, max_tokens=200, structured_outputs=_json(s))
        for i, s in enumerate(chosen)
    ]
    outs = llm.generate(["Some data:"] * len(chosen), params, use_tqdm=False)
    _check_all(outs, chosen, n=4)
    # Each child samples its own stream under its own matcher: the four are not one output copied.
    assert any(len({c.text for c in o.outputs}) > 1 for o in outs)


def test_json_object(llm):
    # Compact: a random model given the choice spends its tokens on whitespace (the default model, which
    # is not random, is tested with whitespace allowed).
    sp = SamplingParams(temperature=0.0, max_tokens=100,
                        structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True))
    out = llm.generate(["An object:"], sp, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text), dict)


def test_regex_choice_and_grammar(llm):
    regex = r"[a-c]{2}-\d{3}"
    choices = ["yes", "no", 'say "maybe"', "naïve\\path"]
    grammar = """
root ::= "(" expr ")"
expr ::= num (op num)?
op ::= "+" | "*"
num ::= [1-9] [0-9]?
"""
    params = [
        SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(temperature=1.0, seed=2, n=4, max_tokens=30, structured_outputs=StructuredOutputsParams(choice=choices)),
        SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=30, structured_outputs=StructuredOutputsParams(grammar=grammar)),
    ]
    r, c, g = llm.generate(["Code:", "Answer:", "Sum:"], params, use_tqdm=False)
    for out in (*r.outputs, *c.outputs, *g.outputs):
        assert out.finish_reason == "stop", out
    assert all(re.fullmatch(regex, o.text) for o in r.outputs)
    assert all(o.text in choices for o in c.outputs)
    assert all(re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?)?\)", o.text) for o in g.outputs)


def test_grammar_end_stops_without_eos(llm):
    """With ignore_eos and no stop tokens, the grammar's end is the request's end (finish_reason stop)."""
    sp = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True,
                        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))
    out = llm.generate(["Pick:"], sp, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("alpha", "beta")
    # Ended by the grammar, not by an EOS token: no stop token was sampled after the text.
    assert llm.get_tokenizer().decode(out.token_ids) == out.text


def test_unconstrained_request_unchanged_by_constrained_neighbours(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    alone = llm.generate(["The weather today"], plain, use_tqdm=False)[0].outputs[0]
    mixed = llm.generate(
        ["JSON:", "The weather today", "Choice:"],
        [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=_json(SCHEMAS[5])), plain,
         SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=["x", "y"]))],
        use_tqdm=False,
    )[1].outputs[0]
    assert mixed.token_ids == alone.token_ids
    for a, b in zip(alone.logprobs, mixed.logprobs):
        assert a.keys() == b.keys()


def test_logprobs_of_masked_tokens_are_minus_infinity(llm):
    """The mask is applied before the sampler, whose logprobs therefore see masked tokens as -inf (as in
    vLLM): the allowed tokens carry all the probability."""
    sp = SamplingParams(temperature=0.0, max_tokens=5, logprobs=5,
                        structured_outputs=StructuredOutputsParams(choice=["yes"]))
    out = llm.generate(["Answer:"], sp, use_tqdm=False)[0].outputs[0]
    first = out.logprobs[0]
    allowed = {tok: lp.logprob for tok, lp in first.items() if lp.logprob > float("-inf")}
    # "yes" starts with one of a few tokens ("y", "ye", "yes"); the rest of the top 5 are masked.
    assert 1 <= len(allowed) < 5 and out.token_ids[0] in allowed
    assert sum(math.exp(v) for v in allowed.values()) == pytest.approx(1.0, abs=1e-4)


def test_async_scheduling_and_preemption_give_the_same_outputs(model_path, llm):
    """A KV cache of a few blocks preempts constrained requests (recomputed, matchers kept), and asynchronous
    scheduling waits for the step in flight: outputs equal those of the roomy synchronous engine."""
    chosen = SCHEMAS[-12:]
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=_json(s)) for s in chosen]
    prompts = [f"Record {i} of the table of measurements, as one JSON value:" for i in range(len(chosen))]
    expected = llm.generate(prompts, params, use_tqdm=False)
    small = _llm(model_path, async_scheduling=True, kv_cache_memory_bytes=256 * 512, max_model_len=256)
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.engine_core.scheduler.num_preemptions > 0
    _check_all(got, chosen)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


@pytest.mark.parametrize("fields, message", [
    ({"json": {"type": "objec"}}, r"structured_outputs\.json: the JSON schema is not supported: .*objec"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, r"structured_outputs\.json"),
    ({"regex": "a(b"}, r"structured_outputs\.regex: the regex is not supported: .*parenthesis"),
    ({"grammar": "root ::= undefined_rule"}, r"structured_outputs\.grammar: .*undefined_rule"),
    ({"grammar": "this is not ebnf"}, r"structured_outputs\.grammar"),
    ({"regex": "a" * 70_000}, r"structured_outputs\.regex is 70000 characters long; at most 65536"),
])
def test_bad_constraints_raise_before_the_core(llm, fields, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**fields)), use_tqdm=False)
    assert not llm.llm_engine.engine_core.structured.has_waiting()


def test_failed_compile_ends_only_its_request(llm):
    """A compile past its deadline fails its request with finish_reason error; the others go on, and the
    same constraint later fails fast from the cache."""
    compiler = llm.llm_engine.engine_core.structured.compiler
    compiler.tokenizer_info  # built before the pool is blocked
    old = compiler.timeout_s
    compiler.timeout_s = 0.0
    # Every pool thread busy until the deadline has passed: the compile cannot finish first.
    release = threading.Event()
    blockers = [compiler._pool.submit(release.wait, 60) for _ in range(compiler._pool._max_workers)]
    try:
        slow = StructuredOutputsParams(json={"type": "object", "properties": {"deadline": {"type": "boolean"}},
                                             "required": ["deadline"]})
        outs = llm.generate(
            ["a", "b"],
            [SamplingParams(max_tokens=20, structured_outputs=slow),
             SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)],
            use_tqdm=False,
        )
    finally:
        compiler.timeout_s = old
        release.set()
        for b in blockers:
            b.result(timeout=60)
    failed, fine = outs[0].outputs[0], outs[1].outputs[0]
    assert failed.finish_reason == "error" and "took longer than 0 s" in failed.stop_reason
    assert fine.finish_reason == "length" and len(fine.token_ids) == 4
    again = llm.generate(["c"], SamplingParams(max_tokens=20, structured_outputs=slow), use_tqdm=False)[0].outputs[0]
    assert again.finish_reason == "error"


def test_compile_cache_reuses_grammars(llm):
    compiler = llm.llm_engine.engine_core.structured.compiler
    schema = {"type": "object", "properties": {"cached": {"enum": ["yes"]}}, "required": ["cached"]}
    hits, compiles = compiler.num_hits, compiler.num_compiles
    sp = SamplingParams(temperature=0.0, n=2, max_tokens=30, structured_outputs=_json(schema))
    llm.generate(["a"], sp, use_tqdm=False)
    llm.generate(["b"], SamplingParams(temperature=0.0, max_tokens=30,
                                       structured_outputs=_json(json.loads(json.dumps(schema)))), use_tqdm=False)
    assert compiler.num_compiles == compiles + 1
    assert compiler.num_hits == hits + 2  # the second child and the second request
