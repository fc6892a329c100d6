"""OpenAPI request bodies for the handlers that read and validate their own JSON.

The POST handlers take the raw `Request` (so every parse failure becomes an OpenAI-shaped 400), which
leaves FastAPI nothing to describe. `request_body` gives a route decorator's `openapi_extra` the
body's JSON schema, built from the same pydantic model the handler validates against, so /openapi.json
documents the real contract and schema-driven clients (and fuzzers) can use it.
"""
from __future__ import annotations

from typing import Any


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    # pydantic points nested models at the model's own "$defs"; in an OpenAPI document "#/$defs/..."
    # would resolve against the document root, so the definitions are substituted in place (the
    # request models nest without cycles).
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref[len("#/$defs/"):]], defs)
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def json_schema(model: Any) -> dict[str, Any]:
    """`model`'s JSON schema (validation mode) with every `$ref` resolved in place."""
    schema = model.model_json_schema(mode="validation")
    defs = schema.pop("$defs", {})
    return _inline(schema, defs)


def request_body(model: Any) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is validated as `model`, with the fields accepted only at
    values that change nothing (unsupported_fields), and no others: unknown fields are refused."""
    from pagedllm.entrypoints.openai.unsupported_fields import accepted_field_schemas

    schema = json_schema(model)
    props = schema.setdefault("properties", {})
    for name, accepted in accepted_field_schemas().items():
        props.setdefault(name, accepted)
    schema["additionalProperties"] = False
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    }
