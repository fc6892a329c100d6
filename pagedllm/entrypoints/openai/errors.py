"""OpenAI-shaped errors: the exception the handlers raise, its JSON body, and translations of
pydantic and SamplingParams errors into 400s that name the offending request field."""
from __future__ import annotations

import json
import logging
import re
import uuid
from http import HTTPStatus
from typing import Any, Iterable, Mapping

_logger = logging.getLogger("pagedllm")

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


def internal_error_body(exc: BaseException, where: str) -> dict[str, Any]:
    """The body of a 500 for an error the server did not expect: a generic message and an id. The
    exception's text may quote the request or the server's internals, so it goes to the log only,
    with its traceback, under that id."""
    error_id = f"error-{uuid.uuid4().hex}"
    _logger.error("unhandled error %s on %s", error_id, where, exc_info=exc)
    return error_body(500, f"Internal server error (id {error_id}); the server's log has the details", code="internal_error")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list"})


def from_validation_error(exc: Any) -> OpenAIError:
    """A pydantic ValidationError as a 400; param is the dotted location of the first error."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    if not errors:
        return bad_request(str(exc))
    first = errors[0]
    # A value that fails every member of a union gets one error per member; a type mismatch is the
    # least telling of them (a list of 100 stop strings is "not a string" as well as "too long").
    same_field = [e for e in errors if e.get("loc", ())[:1] == first.get("loc", ())[:1]]
    first = next((e for e in same_field if not str(e.get("type", "")).endswith("_type")), first)
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    # Union members show up as extra location parts (e.g. "str", "list[int]"): keep real field names.
    loc = [p for p in loc if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*|\d+", p) and p not in _TYPE_NAMES]
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
