"""Tool-call and reasoning parsers on text: each output read whole and streamed in random chunkings gives
the same content, calls and reasoning (streamed call deltas reassembled as an OpenAI client does)."""
from __future__ import annotations

import json
import random

import pytest

from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser


def _chunks(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        k = rng.choice([1, 1, 2, 3, 7, 20])
        out.append(text[i:i + k])
        i += k
    return out


def _streamed(name: str, text: str, seed: int) -> tuple[str, list[tuple[str, dict]]]:
    stream = get_tool_parser(name).stream()
    content = ""
    calls: dict[int, dict] = {}
    pieces = [stream.feed(c) for c in _chunks(text, seed)] + [stream.finish()]
    for piece, deltas in pieces:
        content += piece
        for d in deltas:
            if d.index not in calls:
                # The first delta of a call carries its id and name, as OpenAI's do.
                assert d.id and d.id.startswith("chatcmpl-tool-") and d.name
                calls[d.index] = {"name": d.name, "arguments": ""}
            else:
                assert d.id is None and d.name is None
            calls[d.index]["arguments"] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


WEATHER = {"city": "Paris \"Left\" Bank", "days": 3, "units": None, "tags": ["a}", "{b"]}

CASES = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER)
     + '}\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>',
     "Let me look.", [("get_weather", WEATHER), ("now", {})]),
    ("hermes", "No tools: <tool_ is not a tag.", "No tools: <tool_ is not a tag.", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}', None, [("f", {"a": 1})]),
    ("llama3_json", '{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + '}; {"name": "now", "parameters": {}}',
     None, [("get_weather", WEATHER), ("now", {})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": -1.5e3}}', None, [("f", {"x": -1500.0})]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "Plain text with {\"name\": \"f\"} inside.", "Plain text with {\"name\": \"f\"} inside.", []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(WEATHER)
     + '}, {"name": "now", "arguments": {}}]', "Sure.", [("get_weather", WEATHER), ("now", {})]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]' + json.dumps(WEATHER) + '[TOOL_CALLS]now[ARGS]{}', "Sure.",
     [("get_weather", WEATHER), ("now", {})]),
    ("mistral", "[TOOLS] is not [TOOL_CALLS", "[TOOLS] is not [TOOL_CALLS", []),
    ("pythonic", '[get_weather(city="Paris \\"Left\\" Bank", days=3, units=None, tags=["a}", "{b"]), now()]', None,
     [("get_weather", WEATHER), ("now", {})]),
    ("pythonic", '```tool_code\nget_weather(city="Paris", days=true)\n```', None,
     [("get_weather", {"city": "Paris", "days": True})]),
    ("pythonic", "[1, 2, 3] is a list, not a call.", "[1, 2, 3] is a list, not a call.", []),
    ("pythonic", "```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    ("pythonic", "Hello there.", "Hello there.", []),
]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_tool_parsers_whole_and_streamed(name, text, content, calls):
    whole = get_tool_parser(name).extract(text)
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    assert len({c.id for c in whole.calls}) == len(calls)
    for seed in range(8):
        streamed_content, streamed_calls = _streamed(name, text, seed)
        assert streamed_calls == calls
        assert streamed_content.strip() == (content or "").strip()


def test_content_before_a_call_streams_before_the_call_completes():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Checking the weather") == ("Checking the weather", [])
    content, deltas = stream.feed(" now.<tool")  # a possible marker is held back, the rest goes out
    assert content == " now." and deltas == []
    content, deltas = stream.feed('_call>{"name": "f", "arguments": {"a": ')
    assert content == "" and [(d.name, d.arguments) for d in deltas] == [("f", ""), (None, '{"a": ')]
    assert stream.num_calls == 1


def test_every_parser_is_registered_by_vllm_name():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


REASONING_CASES = [
    ("qwen3", "<think>\nThe user wants colours.\n</think>\n\nRed, green, blue.", "\nThe user wants colours.\n",
     "Red, green, blue."),
    ("qwen3", "Red, green, blue.", None, "Red, green, blue."),
    ("qwen3", "<think>cut off by max_tokens", "cut off by max_tokens", None),
    ("qwen3", "<thinking> is not the tag", None, "<thinking> is not the tag"),
    ("deepseek_r1", "Colours, then.</think>\n\nRed.", "Colours, then.", "Red."),
    ("deepseek_r1", "<think>Colours.</think>Red.", "Colours.", "Red."),
    ("deepseek_r1", "still thinking", "still thinking", None),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING_CASES)
def test_reasoning_split_whole_and_streamed(name, text, reasoning, content):
    parser = get_reasoning_parser(name)
    split = parser.split(text)
    assert (split.reasoning, split.content) == (reasoning, content)
    for seed in range(8):
        stream = parser.stream()
        r, c = "", ""
        for piece in _chunks(text, seed):
            dr, dc = stream.feed(piece)
            r, c = r + dr, c + dc
        dr, dc = stream.finish()
        assert (r + dr, c + dc) == (reasoning or "", content or "")


# ---- a chat choice: reasoning split off first, then tool calls read from the answer --------------------
def _reader(parallel: bool = True):
    from pagedllm.entrypoints.openai.chat_outputs import ChoiceReader
    from pagedllm.entrypoints.openai.tool_calling import ToolPlan

    plan = ToolPlan("auto", None, parser=get_tool_parser("hermes"), parallel=parallel)
    return ChoiceReader(plan, get_reasoning_parser("deepseek_r1"))


THOUGHT_AND_CALLS = ('Weather first.</think>\n\nChecking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                     '</tool_call><tool_call>{"name": "now", "arguments": {}}</tool_call>')


@pytest.mark.parametrize("parallel", [True, False])
def test_chat_choice_reasoning_then_tool_calls_whole_and_streamed(parallel):
    expected = [("get_weather", {"city": "Oslo"}), ("now", {})][:2 if parallel else 1]
    reader = _reader(parallel)
    message = reader.message(THOUGHT_AND_CALLS)
    assert message.reasoning_content == "Weather first." and message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == expected
    assert reader.finish_reason("stop") == "tool_calls" and reader.finish_reason("length") == "length"
    for seed in range(6):
        reader = _reader(parallel)
        pieces = _chunks(THOUGHT_AND_CALLS, seed)
        reasoning, content, calls = "", "", {}
        for i, piece in enumerate(pieces):
            delta = reader.delta(piece, final=i == len(pieces) - 1)
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
            for d in delta.tool_calls or []:
                if d.id is not None:
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
        assert reasoning == "Weather first." and content.strip() == "Checking."
        assert [(n, json.loads(a)) for n, a in calls.values()] == expected
        assert reader.finish_reason("stop") == "tool_calls"


def test_chat_choice_without_calls_keeps_its_finish_reason():
    reader = _reader()
    message = reader.message("Just thinking</think>The answer is 4.")
    assert (message.reasoning_content, message.content, message.tool_calls) == ("Just thinking", "The answer is 4.", None)
    assert reader.finish_reason("stop") == "stop"


# ---- the shipped templates write calls in the format their family's parser reads --------------------
CALLS = [{"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}},
         {"id": "call-2", "type": "function", "function": {"name": "now", "arguments": {"exact": True, "zone": None}}}]
TEMPLATE_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("family,parser,start,end", [
    ("gemma3", "pythonic", "<start_of_turn>model\n", "<end_of_turn>"),
    ("llama3", "llama3_json", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
])
def test_shipped_templates_render_tools_calls_and_results(family, parser, start, end):
    from pagedllm.chat_templates import load_template
    from pagedllm.entrypoints.openai.chat_render import render_chat

    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "call-1", "content": "snow"},
        {"role": "tool", "tool_call_id": "call-2", "content": "noon"},
    ]
    text = render_chat(load_template(family), conversation, {"bos_token": "<bos>"}, tools=TEMPLATE_TOOLS)
    # The tools are described once, before the user's question.
    described = '"parameters": {"type": "object"}'
    assert text.count(described) == 1 and text.index(described) < text.index("Weather in Oslo?")
    written = text.split(start)[1].split(end)[0]
    calls = get_tool_parser(parser).extract(written).calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in CALLS]
    assert "snow" in text and "noon" in text and text.endswith(start)
    # Without tools, the templates render as before (tests/engine/test_chat_templates.py pins that format).
    assert "You may call functions" not in render_chat(load_template(family), conversation[:2], {"bos_token": ""})
