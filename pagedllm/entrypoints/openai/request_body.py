"""The JSON body of a request, parsed strictly: RFC 8259 JSON only (no NaN or Infinity literals, no number
that overflows a double), bounded nesting, and no lone UTF-16 surrogates in any string, each refused
with a 400 that names the field, before pydantic or a tokenizer sees the value; then the request model
and the refusal of fields the server does not implement."""
from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

from pagedllm.entrypoints.openai.errors import bad_request, from_validation_error
from pagedllm.entrypoints.openai.unsupported_fields import refuse_unsupported_fields

# Far deeper than any request of the API needs (chat_template_kwargs is the deepest free-form field),
# and far below what would exhaust Python's recursion limit in pydantic or in a chat template.
MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class _BodyError(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    raise _BodyError(f"{name} is not valid JSON (JSON numbers are finite); send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _BodyError(f"the number {text[:40]} is too large for a 64-bit float")
    return value


def _where(path: list[str | int]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "the request body"


def _depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text, counted outside strings (vectorized:
    a 16 MB list of numbers must not cost seconds of Python)."""
    import numpy as np

    # Drop escaped backslashes, then escaped quotes, so every quote left opens or closes a string.
    b = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), dtype=np.uint8)
    outside = (np.cumsum(b == 0x22, dtype=np.int64) & 1) == 0
    opens = ((b == 0x5B) | (b == 0x7B)) & outside
    closes = ((b == 0x5D) | (b == 0x7D)) & outside
    return int(np.cumsum(opens.astype(np.int32) - closes.astype(np.int32)).max(initial=0))


def _check_depth(raw: bytes, data: dict[str, Any]) -> None:
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH or _depth(raw) <= MAX_DEPTH:
        return
    # Only on the way to an error: which field is it.
    deepest = max(data, key=lambda k: _value_depth(data[k]), default=None)
    where = f"{deepest} is" if deepest is not None else "the request body is"
    raise bad_request(f"{where} nested deeper than {MAX_DEPTH} levels", param=deepest)


def _value_depth(value: Any) -> int:
    try:
        return _depth(json.dumps(value).encode())
    except RecursionError:
        return sys.maxsize


def _surrogate_path(value: Any, path: list[str | int]) -> tuple[list[str | int], str, int] | None:
    """Where the first lone surrogate is: the path, and the string or key holding it."""
    stack: list[tuple[Any, list[str | int]]] = [(value, path)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            bad = _SURROGATE.search(value)
            if bad:
                return path, bad.group(), bad.start()
        elif isinstance(value, dict):
            for key, item in value.items():
                bad = _SURROGATE.search(key)
                if bad:
                    return path, bad.group(), -1
                if isinstance(item, (str, dict, list)):
                    stack.append((item, path + [key]))
        elif isinstance(value, list):
            stack.extend((item, path + [i]) for i, item in enumerate(value) if isinstance(item, (str, dict, list)))
    return None


def _check_surrogates(raw: bytes, data: dict[str, Any]) -> None:
    # Valid UTF-8 holds no surrogates, so only a \uD800-\uDFFF escape can make one; json.loads joins
    # escaped pairs (an emoji sent as ASCII) into one character, so what is left after it is lone.
    if b"\\u" not in raw or not _SURROGATE_ESCAPE.search(raw):
        return
    for key, value in data.items():
        found = _surrogate_path(value, [key]) if not _encodes({key: value}) else None
        if found is None:
            continue
        path, char, at = found
        if at < 0:
            message = f"{_where(path)} has a key holding a lone UTF-16 surrogate (U+{ord(char):04X}), which is not valid Unicode"
        else:
            message = (f"{_where(path)} holds a lone UTF-16 surrogate (U+{ord(char):04X}) at character {at}, "
                       "which is not valid Unicode")
        raise bad_request(message, param=key)
    if not _encodes(data):  # a top-level key
        raise bad_request("the request body has a key holding a lone UTF-16 surrogate, which is not valid Unicode")


def _encodes(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a dict; any way it is not a sound JSON object is a 400 naming where."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except _BodyError as e:
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request(f"The request body is nested too deeply (more than {MAX_DEPTH} levels are refused)") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, and Python's limit on digits of an int
        if "integer string conversion" in str(e):
            raise bad_request(f"The request body holds an integer of more than {sys.get_int_max_str_digits()} digits") from None
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request(f"The request body must be a JSON object, got {type(data).__name__}")
    _check_depth(raw, data)
    _check_surrogates(raw, data)
    return data


def parse_request(raw: bytes, model_cls: Any) -> Any:
    """The body validated as `model_cls` (a protocol request model), with no field the server would
    ignore; blocking (a 16 MB body takes a fraction of a second), so run it off the event loop."""
    from pydantic import ValidationError

    data = parse_json_object(raw)
    try:
        req = model_cls.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None
    refuse_unsupported_fields(req)
    return req
