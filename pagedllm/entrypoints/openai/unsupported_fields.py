"""Request fields the server does not implement: each is refused with a 400 that names it, unless its value
is one that changes nothing (e.g. `store: false`), so that no field is silently ignored. The values accepted
are also JSON schemas, which /openapi.json lists with the fields the server implements."""
from __future__ import annotations

from typing import Any, Callable

from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import bad_request

_TOOLS = "the deprecated functions API is not implemented; send tools and tool_choice"

# name -> (accepted when, why it is refused otherwise).
_KNOWN: dict[str, tuple[Callable[[Any], bool], str]] = {
    # Structured outputs have one backend, xgrammar; naming it (or letting the server pick) changes nothing.
    "guided_decoding_backend": (lambda v: v in (None, "auto", "xgrammar"),
                                'the only structured-outputs backend is xgrammar; only "auto" and "xgrammar" are accepted'),
    "guided_whitespace_pattern": (lambda v: v is None, "a whitespace pattern for JSON is not implemented; "
                                  "structured_outputs.disable_any_whitespace turns whitespace off"),
    "functions": (lambda v: v is None or v == [], _TOOLS),
    "function_call": (lambda v: v in (None, "none", "auto"), _TOOLS + '; only "none" and "auto" are accepted'),
    "prompt_logprobs": (lambda v: v is None, "logprobs of the prompt tokens are not implemented"),
    "modalities": (lambda v: v is None or v == ["text"], 'only text is generated; only ["text"] is accepted'),
    "audio": (lambda v: v is None, "audio output is not implemented"),
    "store": (lambda v: v in (None, False), "the server does not store completions"),
    # Tags for stored completions and for dashboards: the answer is the same with them.
    "metadata": (lambda v: v is None or (isinstance(v, dict) and all(isinstance(x, str) for x in v.values())),
                 "metadata is a map of strings"),
    "service_tier": (lambda v: v in (None, "auto", "default"), 'the server has one tier; only "auto" and "default" are accepted'),
    "prediction": (lambda v: v is None, "predicted outputs are not implemented"),
    "reasoning_effort": (lambda v: v is None, "reasoning effort is not implemented"),
    "web_search_options": (lambda v: v is None, "web search is not implemented"),
    "use_beam_search": (lambda v: v in (None, False), "beam search is not implemented"),
    "priority": (lambda v: v in (None, 0), "request priorities are not implemented"),
}


# The values each field above is accepted at, for /openapi.json (null is accepted for every one of them).
_ACCEPTED_SCHEMAS: dict[str, dict[str, Any]] = {
    "guided_decoding_backend": {"enum": ["auto", "xgrammar"]},
    "functions": {"type": "array", "maxItems": 0},
    "function_call": {"enum": ["none", "auto"]},
    "modalities": {"type": "array", "items": {"enum": ["text"]}, "minItems": 1, "maxItems": 1},
    "store": {"enum": [False]},
    "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
    "service_tier": {"enum": ["auto", "default"]},
    "use_beam_search": {"enum": [False]},
    "priority": {"enum": [0]},
}


def accepted_field_schemas() -> dict[str, dict[str, Any]]:
    """JSON schemas of the fields accepted at values that change nothing."""
    return {name: {"anyOf": [schema, {"type": "null"}]} for name, schema in _ACCEPTED_SCHEMAS.items()}


def _message(where: str, name: str, value: Any) -> str:
    known = _KNOWN.get(name)
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    if known is not None:
        return f"{where} is not supported ({known[1]}), got {shown}"
    return f"{where} is not a field this endpoint knows; unknown fields are refused, not ignored"


def _refuse_extras(model: BaseModel, prefix: str) -> None:
    for name, value in (model.model_extra or {}).items():
        known = _KNOWN.get(name)
        if known is not None and known[0](value):
            continue
        where = f"{prefix}{name}"
        raise bad_request(_message(where, name, value), param=(prefix.split(".")[0] or name))


def refuse_unsupported_fields(req: BaseModel) -> None:
    """400 for the first field of `req` (or of a nested request object) that would otherwise be ignored."""
    _refuse_extras(req, "")
    for name in type(req).model_fields:
        value = getattr(req, name)
        # Nested request objects (stream_options) only; chat messages, in lists, keep their extra keys
        # (name, tool_calls, ...) for the chat template.
        if isinstance(value, BaseModel) and value.model_config.get("extra") == "allow":
            _refuse_extras(value, f"{name}.")
    if getattr(req, "stream_options", None) is not None and not getattr(req, "stream", False):
        raise bad_request("stream_options is only allowed with stream: true", param="stream_options")

