"""Constraint -> grammar conversion (against a small vocabulary) and the compile cache (no model)."""
from __future__ import annotations

import time

import pytest
import xgrammar as xgr
from assets import load_tokenizer

from pagedllm import StructuredOutputsParams
from pagedllm.structured_output.compiler import CompileError, GrammarCompiler
from pagedllm.structured_output.grammar import build_grammar

# Every printable ASCII character and a few control characters, one token each, plus an end token.
VOCAB = [chr(c) for c in range(32, 127)] + ["\x04", "\x1f", "\t", "</s>"]
EOS = len(VOCAB) - 1


@pytest.fixture(scope="module")
def mistral():
    """The compiler reads an HF tokenizer: the Mistral 7B one (32000 tokens) is the smallest test tokenizer."""
    tok = load_tokenizer("mistral")
    return lambda: tok


def _info() -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])


def _accepts(params: StructuredOutputsParams, text: str) -> bool:
    compiled = xgr.GrammarCompiler(_info()).compile_grammar(build_grammar(params))
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.accept_token(EOS)


@pytest.mark.parametrize("schema", [
    {"type": "string", "maxLength": 6},
    {"type": "object", "properties": {"k": {"type": "string", "minLength": 1, "maxLength": 3}}, "required": ["k"]},
])
def test_length_bounded_strings_take_no_raw_control_characters(schema):
    """xgrammar's own grammar for a length-bounded string lets raw control characters in, which no JSON
    parser accepts; the converted grammar keeps JSON's rule."""
    text = '"a\x04"' if schema["type"] == "string" else '{"k": "a\x1f"}'
    assert not _accepts(StructuredOutputsParams(json=schema, disable_any_whitespace=True), text)
    ok = '"ab"' if schema["type"] == "string" else '{"k": "ab"}'
    assert _accepts(StructuredOutputsParams(json=schema, disable_any_whitespace=True), ok)


def test_choice_strings_with_quotes_and_backslashes():
    params = StructuredOutputsParams(choice=['say "hi"', "a\\b", "plain"])
    for choice in params.choice:
        assert _accepts(params, choice)
    assert not _accepts(params, "say hi")


def test_cache_is_bounded_and_keyed_by_the_constraint(mistral):
    compiler = GrammarCompiler(mistral, vocab_size=32000, cache_entries=2)
    try:
        a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
        key_a, fut_a = compiler.submit(a)
        assert compiler.submit(StructuredOutputsParams(regex="a+"))[1] is fut_a
        compiler.submit(b)
        compiler.submit(c)  # evicts a, the least recently used
        assert compiler.lookup(key_a) is None
        assert (compiler.num_compiles, compiler.num_hits) == (3, 1)
        for fut in (fut_a, compiler.submit(c)[1]):
            assert isinstance(fut.result(timeout=30), xgr.CompiledGrammar)
    finally:
        compiler.shutdown()


def test_cache_is_bounded_in_bytes(mistral):
    compiler = GrammarCompiler(mistral, vocab_size=32000, cache_bytes=1)
    try:
        first = compiler.submit(StructuredOutputsParams(regex="a+"))
        first[1].result(timeout=30)
        compiler.submit(StructuredOutputsParams(regex="b+"))
        # Over the byte bound: the compiled "a+" grammar makes way for the new entry.
        assert compiler.lookup(first[0]) is None
    finally:
        compiler.shutdown()


def test_compile_error_names_the_field(mistral):
    compiler = GrammarCompiler(mistral, vocab_size=32000)
    try:
        _, fut = compiler.submit(StructuredOutputsParams(grammar="root ::= missing"))
        with pytest.raises(CompileError, match=r"structured_outputs\.grammar.*missing"):
            fut.result(timeout=30)
    finally:
        compiler.shutdown()


def test_expired_compile_fails_and_stays_failed(mistral):
    compiler = GrammarCompiler(mistral, vocab_size=32000, timeout_s=5.0)
    try:
        key, _ = compiler.submit(StructuredOutputsParams(regex="x{1,3}"))
        compiler._started[key] = time.monotonic() - 10.0  # as if it had been running for 10 s
        compiler.expire()
        with pytest.raises(CompileError, match="took longer than 5 s"):
            compiler.lookup(key).result(timeout=1)
        with pytest.raises(CompileError):
            compiler.submit(StructuredOutputsParams(regex="x{1,3}"))[1].result(timeout=1)
    finally:
        compiler.shutdown()
