"""Where JSON values and object members start and end in text that may still be growing (a model's output
read while it streams): enough to find a tool call's name and the raw text of its arguments before the
call is complete. Complete values are decoded by `json` itself."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_WS = re.compile(r"[ \t\r\n]*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_SCALAR = re.compile(r"[-+0-9.eE]+|true|false|null")
_STRUCTURE = re.compile(r'["{}\[\]]')


class NotJSON(ValueError):
    """The text cannot be the start of the JSON expected there."""


def skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def string_end(text: str, i: int) -> int | None:
    """The index after the string starting at text[i] (a '"'), or None while it is unterminated."""
    m = _STRING.match(text, i)
    return m.end() if m else None


def value_end(text: str, i: int, final: bool) -> int | None:
    """The index after the JSON value starting at text[i], or None while the text ends inside it.

    `final` says no more text will come, so a number running to the end is complete."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth = 0
        j = i
        while True:
            m = _STRUCTURE.search(text, j)
            if m is None:
                return None
            j = m.start()
            ch = text[j]
            if ch == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            depth += 1 if ch in "{[" else -1
            j += 1
            if depth == 0:
                return j
    m = _SCALAR.match(text, i)
    if m is None:
        # A literal still being written ("tr", "nu") is incomplete, not wrong.
        rest = text[i:]
        if any(word.startswith(rest) for word in ("true", "false", "null")):
            return None
        raise NotJSON(f"no JSON value at {text[i:i + 20]!r}")
    if m.end() == len(text) and not final:
        return None
    return m.end()


@dataclass
class ObjectScan:
    """The members of a (possibly partial) JSON object: key -> (value start, value end or None)."""

    members: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None  # the index after the closing brace, once it came


def scan_object(text: str, start: int, final: bool) -> ObjectScan:
    """The members of the object whose '{' is at text[start], as far as the text goes."""
    import json

    out = ObjectScan()
    j = start + 1
    n = len(text)
    while True:
        j = skip_ws(text, j)
        if j >= n:
            return out
        if text[j] == "}":
            out.end = j + 1
            return out
        if text[j] == "," and out.members:
            j += 1
            continue
        if text[j] != '"':
            raise NotJSON(f"expected a key at {text[j:j + 20]!r}")
        key_end = string_end(text, j)
        if key_end is None:
            return out
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= n:
            return out
        if text[j] != ":":
            raise NotJSON(f"expected ':' after key {key!r}")
        j = skip_ws(text, j + 1)
        if j >= n:
            return out
        end = value_end(text, j, final)
        out.members[key] = (j, end)
        if end is None:
            return out
        j = end
