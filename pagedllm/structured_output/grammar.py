"""A constraint as an xgrammar Grammar (tokenizer-free), and the front end's cheap check of it.

Building a Grammar parses the schema, regex or EBNF and converts it, without the tokenizer's vocabulary:
it is cheap (milliseconds), so the front end runs it on every constrained request and a bad constraint
is a ValueError (a 400) before anything reaches the engine core. Compiling against the vocabulary
(compiler.py) happens in the core, off its loop.
"""
from __future__ import annotations

import json
import re

import xgrammar as xgr

from pagedllm.sampling_params import StructuredOutputsParams

# Bounds on a constraint's text: a larger schema or grammar takes long to convert and compile, and no
# real output format needs one this size.
MAX_CONSTRAINT_CHARS = 65_536
MAX_CHOICES = 1024
# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: ", which says nothing to a client.
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def clean_error(error: BaseException) -> str:
    """xgrammar's message without its C++ source location; the first line only."""
    text = _NATIVE_PREFIX.sub("", str(error).strip())
    return text.splitlines()[0] if text else type(error).__name__


def _size(params: StructuredOutputsParams) -> tuple[str, int]:
    kind = params.kind
    if kind == "json":
        value = params.json
        return kind, len(value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        return kind, sum(len(c) for c in params.choice or [])
    if kind == "json_object":
        return kind, 0
    return kind, len(getattr(params, kind))


# xgrammar (0.2.9) writes the characters of a length-bounded JSON string as this class, which lets raw
# control characters through (no JSON parser takes those); the class below is the JSON one.
_LENGTH_BOUNDED_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\"\\\0-\x1f]'


def _json_strings_without_control_chars(grammar: xgr.Grammar) -> xgr.Grammar:
    text = str(grammar)
    if _LENGTH_BOUNDED_CHARS not in text:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(text.replace(_LENGTH_BOUNDED_CHARS, _JSON_STRING_CHARS))
    except Exception:  # noqa: BLE001 - a printed grammar that does not parse back: keep xgrammar's own
        return grammar


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the given strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The constraint as a Grammar; ValueError naming the field and the problem when it does not convert."""
    kind, size = _size(params)
    if size > MAX_CONSTRAINT_CHARS:
        raise ValueError(
            f"structured_outputs.{kind} is {size} characters long; at most {MAX_CONSTRAINT_CHARS} are accepted"
        )
    if kind == "choice" and len(params.choice or []) > MAX_CHOICES:
        raise ValueError(
            f"structured_outputs.choice has {len(params.choice or [])} entries; at most {MAX_CHOICES} are accepted"
        )
    any_whitespace = not params.disable_any_whitespace
    try:
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            return _json_strings_without_control_chars(
                xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
            )
        if kind == "json_object":
            # Any object: not strict, so that properties the empty schema does not list are allowed.
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False
            )
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex or "")
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(params.choice or []))
        return xgr.Grammar.from_ebnf(params.grammar or "")
    except Exception as e:  # noqa: BLE001 - xgrammar raises several types; each is a bad constraint
        what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                "choice": "choice list", "grammar": "grammar"}[kind]
        raise ValueError(f"structured_outputs.{kind}: the {what} is not supported: {clean_error(e)}") from None


def validate(params: StructuredOutputsParams) -> None:
    """The front end's check: raises ValueError (naming the field and the problem) if the constraint
    cannot be converted; the engine core would fail the request for the same reason."""
    build_grammar(params)
