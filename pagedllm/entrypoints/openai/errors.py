"""OpenAI-shaped errors: the exception the handlers raise, its JSON body, and translations of
pydantic and SamplingParams errors into 400s that name the offending request field."""
from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Any, Iterable, Mapping

# OpenAI's error "type" per status; the official client maps the status to its exception class.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    err_type = _TYPES.get(status) or (HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_json_bytes(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps(error_body(status, message, param, code)).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)


def from_validation_error(exc: Any) -> OpenAIError:
    """A pydantic ValidationError as a 400; param is the dotted location of the first error."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    if not errors:
        return bad_request(str(exc))
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    # Union members show up as extra location parts (e.g. "str", "list[int]"): keep real field names.
    loc = [p for p in loc if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*|\d+", p)]
    param = ".".join(loc) or None
    where = f" (field {param})" if param else ""
    return bad_request(f"{first.get('msg', 'invalid value')}{where}", param=param.split(".")[0] if param else None)


_LEADING_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)")


def from_value_error(exc: ValueError, fields: Iterable[str], rename: Mapping[str, str] | None = None) -> OpenAIError:
    """A SamplingParams / Processor ValueError as a 400. Its message starts with the field it is
    about (e.g. "temperature must be >= 0, got -1"); rename maps engine names to the request's own
    (e.g. logprobs -> top_logprobs for chat), in param and in the message."""
    message = str(exc)
    rename = dict(rename or {})
    match = _LEADING_NAME.match(message)
    name = match.group(1) if match else None
    if name in rename:
        message = rename[name] + message[len(name):]
        name = rename[name]
    if name in set(fields) or name in rename.values():
        return bad_request(message, param=name)
    if "prompt" in message:
        return bad_request(message, param="prompt")
    return bad_request(message)
