"""StructuredOutputsParams: the one output constraint of a request (JSON schema, regex, choice, grammar).

Field names follow vLLM's ``StructuredOutputsParams``. The checks here are the cheap, model-free
ones (types, exactly one kind of constraint); whether a schema, regex or grammar compiles is checked
by the backend against the model's tokenizer.
"""
from __future__ import annotations

import hashlib
import json as _json
from dataclasses import dataclass, fields
from typing import Any

# The constraint kinds; exactly one of them must be set.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


def _fail(name: str, value: Any, rule: str) -> None:
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    raise ValueError(f"structured_outputs.{name} must be {rule}, got {shown}")


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output; exactly one of json, regex, choice, grammar, json_object."""

    # A JSON schema, as a dict or as its JSON text.
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    # A grammar in GBNF / EBNF (xgrammar's dialect, which takes llama.cpp's GBNF).
    grammar: str | None = None
    # Any JSON object, no schema.
    json_object: bool | None = None
    # Without whitespace between JSON tokens (compact output, fewer tokens).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = _json.loads(self.json)
                except ValueError as e:
                    _fail("json", self.json, f"a JSON schema (an object or its JSON text); it does not parse: {e}")
                if not isinstance(parsed, (dict, bool)):
                    _fail("json", self.json, "a JSON schema: a JSON object (or true/false)")
            elif not isinstance(self.json, (dict, bool)):
                _fail("json", self.json, "a JSON schema: a dict or its JSON text")
        if self.regex is not None and (not isinstance(self.regex, str) or self.regex == ""):
            _fail("regex", self.regex, "a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple)):
                _fail("choice", self.choice, "a non-empty list of strings")
            self.choice = list(self.choice)
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                _fail("choice", self.choice, "a non-empty list of strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            _fail("grammar", self.grammar, "a non-empty GBNF/EBNF string")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            _fail("json_object", self.json_object, "a boolean")
        if not isinstance(self.disable_any_whitespace, bool):
            _fail("disable_any_whitespace", self.disable_any_whitespace, "a boolean")
        kinds = self.kinds()
        if len(kinds) != 1:
            got = ", ".join(kinds) if kinds else "none"
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(CONSTRAINT_FIELDS)}; got {len(kinds)} ({got})"
            )

    def kinds(self) -> list[str]:
        """The constraint fields that are set (json_object counts only when true)."""
        set_ = []
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if name == "json_object":
                if value:
                    set_.append(name)
            elif value is not None:
                set_.append(name)
        return set_

    @property
    def kind(self) -> str:
        return self.kinds()[0]

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for the wire to the engine core)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_value(cls, value: StructuredOutputsParams | dict[str, Any]) -> StructuredOutputsParams:
        """Accepts the dataclass itself or its dict form (vLLM's extra-body shape, or to_dict's)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams or a mapping, got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"structured_outputs has unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**value)

    def cache_key(self) -> str:
        """A digest of the constraint: equal constraints share one compiled grammar."""
        spec = self.to_dict()
        if isinstance(spec["json"], str):
            # Two spellings of one schema (key order, spacing) compile to the same grammar.
            spec["json"] = _json.loads(spec["json"])
        text = _json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()
