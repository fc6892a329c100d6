"""StructuredOutputsParams: validation and the trip through the engine-core wire schema."""
from __future__ import annotations

import pytest

from pagedllm import SamplingParams, StructuredOutputsParams
from pagedllm.engine.core_messages import AddRequest, input_decoder, input_encoder, params_from_dict, params_to_dict


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of json, regex, choice, grammar, json_object; got 0"),
    ({"json": {"type": "object"}, "regex": "a+"}, "got 2 (json, regex)"),
    ({"json_object": False}, "got 0"),
    ({"choice": "yes"}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"choice": ["a", 1]}, "structured_outputs.choice"),
    ({"json": "{not json"}, "structured_outputs.json must be a JSON schema"),
    ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON schema"),
    ({"json": 3}, "structured_outputs.json"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"grammar": "  "}, "structured_outputs.grammar must be a non-empty"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be a boolean"),
    ({"json_object": True, "disable_any_whitespace": 1}, "disable_any_whitespace must be a boolean"),
])
def test_bad_params_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        StructuredOutputsParams(**fields)


def test_unknown_field_in_dict_form():
    with pytest.raises(ValueError, match="unknown field.*whitespace_patern"):
        SamplingParams(structured_outputs={"json_object": True, "whitespace_patern": " "})


def test_cache_key_ignores_schema_spelling():
    a = StructuredOutputsParams(json='{"type": "object", "required": ["a"]}')
    b = StructuredOutputsParams(json={"required": ["a"], "type": "object"})
    c = StructuredOutputsParams(json={"required": ["b"], "type": "object"})
    assert a.cache_key() == b.cache_key() != c.cache_key()
    assert StructuredOutputsParams(json_object=True).cache_key() != StructuredOutputsParams(
        json_object=True, disable_any_whitespace=True).cache_key()


def test_params_cross_the_core_wire():
    so = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"enum": [1, 2]}}},
                                 disable_any_whitespace=True)
    sent = AddRequest("r", [1, 2], params_to_dict(SamplingParams(structured_outputs=so)), 7, [3])
    received = input_decoder().decode(input_encoder().encode(sent))
    params = params_from_dict(received.params)
    assert params.structured_outputs == so
    assert params_from_dict(params_to_dict(SamplingParams())).structured_outputs is None
