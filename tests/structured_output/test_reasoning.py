"""Structured outputs with a reasoning parser: the grammar constrains the answer after `</think>`, never the
reasoning. The gate's states on token ids, then end to end on a tiny random model with the Qwen3 tokenizer,
whose `<think>`/`</think>` are single added tokens."""
from __future__ import annotations

import json

import pytest
from tiny_models import make_tiny_model_with_tokenizer

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.reasoning import REASONING_MARKERS, ReasoningTokens

pytestmark = pytest.mark.timeout(300)

S, E = 7, 8  # one-token delimiters
ONE_TOKEN = ReasoningTokens((S,), (E,), starts_in_reasoning=False)


@pytest.mark.parametrize("prompt,state", [
    ([1, 2, 3], "start"),  # Qwen3 thinking on: the model may open a block itself
    ([1, S, 4, E, 5], "answer"),  # an empty block closed by the template (enable_thinking false)
    ([1, S, 4, E, 5, S], "reasoning"),  # the last delimiter wins
    ([1, S], "reasoning"),
])
def test_the_prompt_sets_the_first_state(prompt, state):
    assert ONE_TOKEN.gate(prompt).state == state


def test_a_template_that_opens_the_block_starts_in_reasoning():
    r1 = ReasoningTokens((S,), (E,), starts_in_reasoning=True)
    assert r1.gate([1, 2]).state == "reasoning" and r1.gate([S, E]).state == "answer"


def test_start_offers_the_delimiter_then_reasoning_runs_to_the_end_delimiter():
    g = ONE_TOKEN.gate([1])
    assert g.constrained and g.also_allowed == S
    assert g.feed(S) is False and not g.constrained and g.also_allowed is None
    assert [g.feed(t) for t in (4, 5, E)] == [False, False, False]
    assert g.constrained and g.feed(9) is True


def test_an_answer_without_a_block_is_the_grammars_from_its_first_token():
    g = ONE_TOKEN.gate([1])
    assert g.feed(9) is True and g.state == "answer" and g.also_allowed is None


def test_an_end_delimiter_of_several_tokens_is_matched_across_steps():
    g = ReasoningTokens((S,), (3, 4, 5), starts_in_reasoning=True).gate([1])
    assert [g.feed(t) for t in (3, 4, 3, 4, 5)] == [False] * 5 and g.constrained
    assert g.feed(3) is True


def test_a_several_token_start_delimiter_is_not_offered_beside_the_grammar():
    # The mask could offer only its first token, which the grammar may not reach: the answer starts at once.
    assert ReasoningTokens((3, 4), (5,), starts_in_reasoning=False).gate([1]).state == "answer"


# ---- end to end --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model_with_tokenizer("qwen3", tmp_path_factory.mktemp("reasoning-qwen3"))


def _ids(llm, text: str) -> int:
    return llm.get_tokenizer().convert_tokens_to_ids(text)


def test_delimiters_are_read_from_the_tokenizer(model_path):
    llm = LLM(model=model_path, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 24, max_model_len=256,
              reasoning_parser="qwen3")
    tokens = ReasoningTokens.from_tokenizer(REASONING_MARKERS["qwen3"], llm.get_tokenizer())
    assert tokens.start == (_ids(llm, "<think>"),) and tokens.end == (_ids(llm, "</think>"),)


def test_the_grammar_applies_after_the_reasoning_ends(model_path):
    llm = LLM(model=model_path, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 25, max_model_len=512,
              reasoning_parser="deepseek_r1")
    tok = llm.get_tokenizer()
    end = _ids(llm, "</think>")
    # A bias that makes `</think>` likely but not certain at each step: some reasoning first, then the answer.
    choice = StructuredOutputsParams(choice=["alpha", "beta"])
    sp = SamplingParams(temperature=1.0, seed=0, n=6, max_tokens=120, logit_bias={end: 12.0},
                        skip_special_tokens=False, structured_outputs=choice)
    out = llm.generate(["Think, then pick:"], sp, use_tqdm=False)[0]
    lengths = []
    for c in out.outputs:
        assert c.finish_reason == "stop", c
        assert end in c.token_ids, c.token_ids  # sampled without the mask, which would have refused it
        at = c.token_ids.index(end)
        lengths.append(at)
        assert tok.decode(c.token_ids[at + 1:], skip_special_tokens=True) in ("alpha", "beta")
    assert max(lengths) > 0  # reasoning tokens were generated, unconstrained, before the answer
    # A prompt whose template closed an empty block is constrained from the first token.
    closed = tok.decode([_ids(llm, "<think>")]) + "\n\n" + tok.decode([end]) + "\n\n"
    sp = SamplingParams(temperature=1.0, seed=0, n=3, max_tokens=20, logit_bias={end: 12.0}, structured_outputs=choice)
    for c in llm.generate(["Pick:" + closed], sp, use_tqdm=False)[0].outputs:
        assert c.finish_reason == "stop" and c.text in ("alpha", "beta")
    # after_reasoning=False (the completions API's requests): the grammar owns the first token, though the
    # parser would start this prompt in reasoning.
    sp = SamplingParams(temperature=1.0, seed=0, n=3, max_tokens=20, logit_bias={end: 12.0},
                        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"], after_reasoning=False))
    for c in llm.generate(["Think, then pick:"], sp, use_tqdm=False)[0].outputs:
        assert c.finish_reason == "stop" and c.text in ("alpha", "beta")


def test_a_model_that_answers_without_thinking_is_constrained_from_its_first_token(model_path):
    # Qwen3's parser: no block in the prompt, and a random model almost never opens one.
    llm = LLM(model=model_path, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 24, max_model_len=256,
              reasoning_parser="qwen3")
    think = _ids(llm, "<think>")
    # The mask offers `<think>` beside the few tokens that can open the answer: a model that does not think
    # gives it no weight.
    sp = SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=60, logit_bias={think: -100.0},
                        structured_outputs=StructuredOutputsParams(regex=r"\{\"a\": [0-9]{1,3}\}"))
    for c in llm.generate(["JSON:"], sp, use_tqdm=False)[0].outputs:
        assert c.finish_reason == "stop" and isinstance(json.loads(c.text)["a"], int)
    # Biased towards `<think>`, the first token opens a block (the mask offers it), and the rest is reasoning.
    sp = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={think: 30.0}, skip_special_tokens=False,
                        structured_outputs=StructuredOutputsParams(choice=["x"]))
    c = llm.generate(["JSON:"], sp, use_tqdm=False)[0].outputs[0]
    assert c.token_ids[0] == think and c.finish_reason == "length"
