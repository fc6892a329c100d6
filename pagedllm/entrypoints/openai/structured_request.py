"""A request's output constraint: OpenAI's `response_format`, vLLM's `structured_outputs` and its older
`guided_*` fields (or the JSON a forced tool call must be) as one StructuredOutputsParams, with the
request field it came from, so that every error about it names that field."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.async_llm import RequestFailedError
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, error_body
from pagedllm.sampling_params import StructuredOutputsParams


@dataclass
class Constraint:
    params: StructuredOutputsParams
    field: str  # the request field that set it, as errors name it


def _build(field: str, kind_fields: dict[str, Any]) -> Constraint:
    try:
        return Constraint(StructuredOutputsParams(**kind_fields), field)
    except ValueError as e:
        raise bad_request(rename_message(str(e), field), param=field.split(".")[0]) from None


def rename_message(message: str, field: str) -> str:
    """An engine message about `structured_outputs.<kind>` in the request's own words."""
    if field.startswith("structured_outputs"):
        return message
    return re.sub(r"^structured_outputs(\.\w+)?", field, message)


def _from_response_format(rf: Any) -> Constraint | None:
    if rf is None or rf.type == "text":
        if rf is not None and rf.json_schema is not None:
            raise bad_request('response_format.json_schema needs type "json_schema", got type "text"',
                              param="response_format")
        return None
    if rf.type == "json_object":
        return _build("response_format", {"json_object": True})
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad_request('response_format of type "json_schema" needs json_schema.schema, a JSON schema',
                          param="response_format")
    return _build("response_format.json_schema.schema", {"json": rf.json_schema.schema_})


def request_constraints(req: Any) -> list[Constraint]:
    """Every constraint the request's own fields set (more than one is an error the caller reports)."""
    out: list[Constraint] = []
    c = _from_response_format(req.response_format)
    if c is not None:
        out.append(c)
    so = req.structured_outputs
    if so is not None and not _options_only(so):
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                  "json_object": so.json_object, "disable_any_whitespace": so.disable_any_whitespace}
        out.append(_build("structured_outputs", fields))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            out.append(_build(name, {kind: value}))
    return out


def _options_only(so: Any) -> bool:
    """`structured_outputs` that sets no constraint, only how another field's constraint is applied (as in
    vLLM, where response_format fills in the request's structured_outputs)."""
    return all(v is None for v in (so.json_, so.regex, so.choice, so.grammar)) and not so.json_object


def one_constraint(req: Any, constraints: list[Constraint]) -> Constraint | None:
    if len(constraints) > 1:
        names = [c.field.split(".")[0] for c in constraints]
        raise bad_request(
            f"{' and '.join(names)} each constrain the output; a request may set only one of them",
            param=names[1],
        )
    so = req.structured_outputs
    if so is not None and _options_only(so):
        if not constraints:
            raise bad_request(
                "structured_outputs must set one of json, regex, choice, grammar or json_object (or come with "
                "response_format, a guided_* field or a forced tool call, whose constraint its options then shape)",
                param="structured_outputs",
            )
        constraints[0].params.disable_any_whitespace = so.disable_any_whitespace
    return constraints[0] if constraints else None


def name_engine_error(err: OpenAIError, constraint: Constraint | None) -> OpenAIError:
    """A 400 from the engine (a schema, regex or grammar that does not compile) that names the field."""
    if constraint is None or err.param not in (None, "structured_outputs"):
        return err
    err.message = rename_message(err.message, constraint.field)
    err.param = constraint.field.split(".")[0]
    return err


# How the engine words a constraint that did not compile (a token the mask let through is the engine's fault,
# not the request's, and stays a 500).
_COMPILE_FAILURES = ("could not be compiled", "compiling the structured_outputs constraint took longer",
                     "structured outputs need the model's tokenizer")


def compile_failure(e: BaseException, constraint: Constraint | None) -> OpenAIError | None:
    """A 400 naming the field, for a request the engine ended because its constraint did not compile (in the
    compile pool, past its deadline, or with an error the front end's check could not see); None otherwise."""
    message = str(e)
    if constraint is None or not isinstance(e, RequestFailedError) or not any(w in message for w in _COMPILE_FAILURES):
        return None
    return bad_request(rename_message(message, constraint.field), param=constraint.field.split(".")[0])


def compile_failure_event(e: BaseException, constraint: Constraint | None) -> str | None:
    """The same, as the error event that ends a stream."""
    err = compile_failure(e, constraint)
    if err is None:
        return None
    return f"data: {json.dumps(error_body(err.status, err.message, err.param))}\n\n"
