"""JSON schemas for structured-output tests: many small ones, bounded so that any output finishes quickly.

Every leaf bounds its length (enums, integer ranges, maxLength, maxItems), since a random model
emits whatever the grammar allows and would otherwise run to max_tokens inside an unbounded string.
"""
from __future__ import annotations

import json
import random
import re

from jsonschema import Draft202012Validator, FormatChecker

LEAVES: list[dict] = [
    {"type": "integer", "minimum": -5, "maximum": 120},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 7},
    {"type": "string", "maxLength": 6},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"enum": [1, "two", None, True]},
    {"type": "boolean"},
    {"type": "null"},
    {"const": 42},
    {"type": "string", "format": "date"},
    {"type": "string", "pattern": "^[a-z]{1,4}$"},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    {"type": ["string", "null"], "maxLength": 3},
]

RECURSIVE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
                "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
            },
            "required": ["v", "next"],
        }
    },
    "$ref": "#/$defs/node",
}


def _object(rng: random.Random, depth: int) -> dict:
    props = {}
    for i in range(rng.randint(1, 3)):
        roll = rng.random()
        if depth < 2 and roll < 0.2:
            props[f"o{i}"] = _object(rng, depth + 1)
        elif depth < 2 and roll < 0.3:
            props[f"l{i}"] = {"type": "array", "items": _object(rng, depth + 1), "maxItems": 2}
        else:
            props[f"k{i}"] = rng.choice(LEAVES)
    return {"type": "object", "properties": props, "required": sorted(props)}


def schemas(count: int, seed: int = 0) -> list[dict]:
    """``count`` schemas: every leaf alone, each wrapped in an object, the recursive one, then random
    nestings of objects, arrays and leaves."""
    out: list[dict] = [RECURSIVE, *LEAVES, *({"type": "object", "properties": {"x": leaf}, "required": ["x"]} for leaf in LEAVES)]
    out.append({"anyOf": [{"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
                          {"type": "array", "items": {"type": "null"}, "maxItems": 2}]})
    rng = random.Random(seed)
    while len(out) < count:
        out.append(_object(rng, 0))
    return out[:count]


_FORMATS = FormatChecker()


@_FORMATS.checks("date")
def _rfc3339_full_date(value: object) -> bool:
    # RFC 3339's full-date, year 0000 included (jsonschema's own check, Python's date.fromisoformat,
    # refuses year 0, which the RFC and the grammar allow).
    if not isinstance(value, str):
        return True
    m = re.fullmatch(r"(\d{4})-(\d{2})-(\d{2})", value)
    if m is None:
        return False
    year, month, day = (int(g) for g in m.groups())
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    days = [31, 29 if leap else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
    return 1 <= month <= 12 and 1 <= day <= days[month - 1]


def assert_valid(text: str, schema: dict) -> None:
    value = json.loads(text)
    Draft202012Validator(schema, format_checker=_FORMATS).validate(value)
