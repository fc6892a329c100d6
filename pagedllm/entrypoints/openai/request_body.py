"""The JSON body of a request, parsed strictly: RFC 8259 JSON only (no NaN or Infinity literals, no number
that overflows a double), bounded nesting, and no lone UTF-16 surrogates in any string, each refused
with a 400 that names the field, before pydantic or a tokenizer sees the value."""
from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request

# Far deeper than any request of the API needs (chat_template_kwargs is the deepest free-form field),
# and far below what would exhaust Python's recursion limit in pydantic or in a chat template.
MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


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


def _check_tree(data: Any) -> None:
    """Depth and lone surrogates, walked without recursion (the body may be nested on purpose)."""
    stack: list[tuple[Any, list[str | int]]] = [(data, [])]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            bad = _SURROGATE.search(value)
            if bad:
                raise _field_error(
                    path, f"{_where(path)} holds a lone UTF-16 surrogate (U+{ord(bad.group()):04X}) at character "
                    f"{bad.start()}, which is not valid Unicode"
                )
            continue
        if not isinstance(value, (dict, list)):
            continue
        if len(path) >= MAX_DEPTH:
            raise _field_error(path, f"{_where(path)} is nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                bad = _SURROGATE.search(key)
                if bad:
                    raise _field_error(
                        path, f"{_where(path)} has a key holding a lone UTF-16 surrogate (U+{ord(bad.group()):04X}), "
                        "which is not valid Unicode"
                    )
                stack.append((item, path + [key]))
        else:
            stack.extend((item, path + [i]) for i, item in enumerate(value))


def _field_error(path: list[str | int], message: str) -> OpenAIError:
    param = path[0] if path and isinstance(path[0], str) else None
    return bad_request(message, param=param)


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
    _check_tree(data)
    return data
