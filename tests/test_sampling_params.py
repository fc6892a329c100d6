"""SamplingParams validation: every out-of-range field raises ValueError naming the field, value and range."""
from __future__ import annotations

import pytest

from pagedllm import SamplingParams

INVALID = [
    ("n", 0, ">= 1"),
    ("temperature", -0.1, "[0, 3.403e+38]"),
    # Beyond float32 the sampler's division overflows to infinity and masked logits become NaN.
    ("temperature", 1e39, "float32's largest"),
    ("temperature", float("inf"), "finite"),
    ("temperature", float("nan"), "finite"),
    ("top_p", float("nan"), "(0, 1]"),
    ("min_p", float("inf"), "[0, 1]"),
    ("presence_penalty", float("nan"), "[-2, 2]"),
    ("repetition_penalty", float("inf"), "[0.01, 2]"),
    ("repetition_penalty", 1e-45, "[0.01, 2]"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"),
    ("top_k", -2, "-1"),
    ("min_p", 1.5, "[0, 1]"),
    ("presence_penalty", 2.5, "[-2, 2]"),
    ("frequency_penalty", -3.0, "[-2, 2]"),
    ("repetition_penalty", 0.0, "[0.01, 2]"),
    ("max_tokens", 0, ">= 1"),
    ("min_tokens", -1, ">= 0"),
    ("logprobs", 21, "[0, 20]"),
    ("prompt_logprobs", -1, "[0, 20]"),
    ("stop", [""], "non-empty"),
    ("stop_token_ids", [-5], "non-negative"),
    ("allowed_token_ids", [], "non-empty"),
    ("seed", 1.5, "integer"),
]


@pytest.mark.parametrize("field,value,rule", INVALID)
def test_invalid_field_names_field_value_and_range(field, value, rule):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    msg = str(e.value)
    assert field in msg and repr(value) in msg and rule in msg


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_logit_bias_range_and_vocab():
    with pytest.raises(ValueError, match=r"logit_bias\[3\] must be in \[-100, 100\], got 200.0"):
        SamplingParams(logit_bias={3: 200})
    p = SamplingParams(logit_bias={"7": 1.0}, allowed_token_ids=[1, 2])
    assert p.logit_bias == {7: 1.0}
    with pytest.raises(ValueError, match=r"logit_bias holds token id 7, outside the vocabulary \[0, 5\)"):
        p.verify_vocab(5)
    with pytest.raises(ValueError, match="allowed_token_ids holds token id 9"):
        SamplingParams(allowed_token_ids=[9]).verify_vocab(5)


def test_valid_defaults_and_normalisation():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, stop="x")
    assert p.greedy and p.top_p == 1.0 and p.top_k == -1 and p.stop == ["x"]
    assert SamplingParams(top_k=0).top_k == -1
    assert not SamplingParams().has_penalties and SamplingParams(repetition_penalty=1.2).has_penalties
