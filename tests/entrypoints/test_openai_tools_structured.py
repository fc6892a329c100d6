"""Structured outputs, tool calling and reasoning through a real `pagedllm serve` (a tiny random Llama with
the Qwen3 tokenizer and chat template, --enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser deepseek_r1) and the official openai client: constrained outputs validate against their
schemas, forced tool calls come back as OpenAI's tool_calls (whole and streamed), tool results render,
reasoning goes to reasoning_content, and bad constraints are 400s naming the field.

A completion's constraint applies from its first token (its text is not split into reasoning); a chat
request's applies after `</think>` unless thinking is turned off (`enable_thinking: false`)."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from serve_helpers import Server, make_model, sse_events

# A server start-up of its own: slow (CI runs it), and bounded.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "tiny-qwen"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# Bounded schemas: a random model must still finish them within max_tokens.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}, "exact": {"type": "boolean"}},
    "required": ["zone", "exact"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# A random model allowed whitespace between JSON tokens spends its tokens on it: compact JSON, asked for
# as in vLLM (structured_outputs carrying only options for the constraint another field sets).
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
BASE = dict(model=MODEL, max_tokens=200, temperature=0.8, seed=1, extra_body={**COMPACT, **NO_THINKING})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools_server")
    model = make_model("qwen3", root / "qwen3", tie=True)
    s = Server("tools", model, ["--served-model-name", MODEL, "--max-model-len", "1024",
                                "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                "--reasoning-parser", "deepseek_r1"], root)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _kwargs(**over):
    kw = dict(BASE)
    kw.update(over)
    return kw


def _check_calls(calls, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(chunks) -> tuple[list[dict], list[str]]:
    calls: dict[int, dict] = {}
    finishes = []
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id.startswith("chatcmpl-tool-") and d.type == "function" and d.function.name
                    calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
                else:
                    assert d.id is None and d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finishes


# ---- structured outputs ------------------------------------------------------------------------------
def test_response_format_json_schema_whole_and_streamed(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    out = client.chat.completions.create(messages=MESSAGES, response_format=fmt, n=2, **_kwargs())
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), WEATHER)
    chunks = list(client.chat.completions.create(messages=MESSAGES, response_format=fmt, stream=True, **_kwargs()))
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), WEATHER)


def test_parse_with_a_pydantic_model(client):
    class Answer(BaseModel):
        sunny: bool
        rating: int

    out = client.chat.completions.parse(messages=MESSAGES, response_format=Answer, **_kwargs())
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Answer) and out.choices[0].finish_reason == "stop"


def test_completions_choice_regex_and_json_object(client):
    out = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, temperature=1.0, seed=3,
                                    extra_body={"guided_choice": ["yes", "no", "maybe not"]})
    assert out.choices[0].text in ("yes", "no", "maybe not")
    out = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=1.0, seed=3,
                                    extra_body={"structured_outputs": {"regex": "[A-F]{3}-[0-9]{2}"}})
    assert re.fullmatch("[A-F]{3}-[0-9]{2}", out.choices[0].text)
    out = client.chat.completions.create(messages=MESSAGES, response_format={"type": "json_object"},
                                         **_kwargs(max_tokens=40, temperature=0))
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)


# ---- tools -------------------------------------------------------------------------------------------
def test_tool_choice_required_whole_and_streamed(client):
    # A random model given the choice goes on calling tools until max_tokens: every complete call counts.
    out = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="required", **_kwargs())
    choice = out.choices[0]
    assert choice.finish_reason in ("tool_calls", "length") and choice.message.content is None
    _check_calls(choice.message.tool_calls, set(SCHEMAS))
    # One call at most (parallel_tool_calls false): the output ends after it.
    for seed in (2, 3):
        one = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, **_kwargs(seed=seed))
        assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls) == 1
        _check_calls(one.choices[0].message.tool_calls, set(SCHEMAS))
        chunks = list(client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                     parallel_tool_calls=False, stream=True, **_kwargs(seed=seed)))
        calls, finishes = _streamed_calls(chunks)
        assert finishes == ["tool_calls"] and len(calls) == 1
        assert calls[0]["name"] == one.choices[0].message.tool_calls[0].function.name
        assert json.loads(calls[0]["arguments"]) == json.loads(one.choices[0].message.tool_calls[0].function.arguments)
        jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


def test_named_tool_choice_whole_and_streamed(client, server):
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice=named, **_kwargs())
    calls = out.choices[0].message.tool_calls
    assert len(calls) == 1 and out.choices[0].finish_reason == "tool_calls"
    _check_calls(calls, {"get_time"})
    chunks = list(client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice=named, stream=True,
                                                 **_kwargs(seed=5)))
    streamed, finishes = _streamed_calls(chunks)
    assert finishes == ["tool_calls"] and [c["name"] for c in streamed] == ["get_time"]
    jsonschema.validate(json.loads(streamed[0]["arguments"]), TIME)
    # On the wire, as OpenAI's: the first delta of a call names it, later ones carry argument text only.
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": named, "stream": True,
            "max_tokens": 200, "seed": 5, "temperature": 0.8, **COMPACT, **NO_THINKING}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
    deltas = [c["delta"] for e in events[:-1] for c in e["choices"]]
    assert all(len(d["tool_calls"]) == 1 for d in deltas if "tool_calls" in d)  # one entry per call a chunk
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert deltas[0] == {"role": "assistant", "content": ""} and all(None not in d.values() for d in deltas)
    assert calls[0] == {"index": 0, "id": calls[0]["id"], "type": "function",
                        "function": {"name": "get_time", "arguments": calls[0]["function"]["arguments"]}}
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == json.loads(streamed[0]["arguments"])


def test_tool_result_round_trip_renders_in_the_prompt(client, server):
    first = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, **_kwargs())
    call = first.choices[0].message.tool_calls[0]
    conversation = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"},
    ]
    out = client.chat.completions.create(messages=conversation, tools=TOOLS, tool_choice="none",
                                         **_kwargs(max_tokens=5, extra_body=None))
    assert out.choices[0].finish_reason in ("stop", "length") and not out.choices[0].message.tool_calls
    # The template saw the tools, the call (its arguments as an object) and the result.
    body = {"messages": conversation}
    ids = httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert "<tool_response>\nsunny, 21 degrees\n</tool_response>" in text
    assert json.dumps(json.loads(call.function.arguments), ensure_ascii=False) in text


def test_auto_tool_choice_reads_free_text_with_the_server_parser(client, server):
    # A random model writes no <tool_call>: no calls, and the tools reached the template.
    out = client.chat.completions.create(messages=MESSAGES, tools=TOOLS,
                                         **_kwargs(max_tokens=8, temperature=0, extra_body=None))
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")
    r = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES, "tools": TOOLS}, timeout=30)
    without = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()["count"]
    assert out.usage.prompt_tokens == r.json()["count"] > without + 100  # the tools' schemas are in the prompt
    # An empty tool list leaves nothing to require: plain text, as with "none".
    plain = client.chat.completions.create(messages=MESSAGES, tools=[], tool_choice="required",
                                           **_kwargs(max_tokens=4, extra_body=NO_THINKING)).choices[0]
    assert plain.message.content and plain.message.tool_calls is None


def test_auto_tool_choice_parses_hermes_calls_whole_and_streamed(client):
    # The output is forced (guided_choice) to what a Qwen model writes when it calls a tool.
    written = ('Let me check. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC", "exact": true}}\n'
               '</tool_call>')
    kw = _kwargs(extra_body={"guided_choice": [written], **NO_THINKING})
    out = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="auto", **kw).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in out.message.tool_calls] == [
        ("get_time", {"zone": "UTC", "exact": True})]
    chunks = list(client.chat.completions.create(messages=MESSAGES, tools=TOOLS, stream=True, **kw))
    calls, finishes = _streamed_calls(chunks)
    assert finishes == ["tool_calls"] and [c["name"] for c in calls] == ["get_time"]
    assert json.loads(calls[0]["arguments"]) == {"zone": "UTC", "exact": True}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == "Let me check."


# ---- reasoning ---------------------------------------------------------------------------------------
def test_reasoning_goes_to_reasoning_content_whole_and_streamed(client):
    # DeepSeek-R1's parser: everything before </think> is reasoning, and a random model never closes it.
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.message.reasoning_content and whole.message.content is None
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole.message.reasoning_content
    assert not "".join(d.content or "" for d in deltas)
    # Thinking turned off in the template: no reasoning to split off.
    kw["extra_body"] = {"ignore_eos": True, **NO_THINKING}
    plain = client.chat.completions.create(**kw).choices[0]
    assert plain.message.content and plain.message.reasoning_content is None


# ---- bad input ---------------------------------------------------------------------------------------
def _named(**extra) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, **NO_THINKING, **extra}


BAD = [
    (_named(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format", "schema"),
    (_named(response_format={"type": "json_object"}, guided_json=WEATHER), "guided_json", "response_format"),
    (_named(guided_regex="(unclosed"), "guided_regex", "guided_regex"),
    (_named(structured_outputs={"json": "{not json"}), "structured_outputs", "structured_outputs.json"),
    (_named(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs", "exactly one"),
    (_named(structured_outputs={"regex": "a", "backend": "outlines"}), "structured_outputs", "backend"),
    (_named(guided_choice=[]), "guided_choice", "non-empty"),
    (_named(**COMPACT), "structured_outputs", "one of json"),
    (_named(guided_decoding_backend="outlines"), "guided_decoding_backend", "xgrammar"),
    (_named(guided_whitespace_pattern=" *"), "guided_whitespace_pattern", "disable_any_whitespace"),
    (_named(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
    (_named(tool_choice="required"), "tool_choice", "tools"),
    (_named(tools=TOOLS + TOOLS[:1]), "tools", "get_weather"),
    (_named(tools=[{"type": "function", "function": {"name": "f", "parametrs": {}}}]), "tools", "parametrs"),
    (_named(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tools",
     "response_format"),
    (_named(messages=[{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                            "function": {"name": "f", "arguments": "{x"}}]}]),
     "messages", "messages[0].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("body,param,says", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_constraints_and_tools_are_400s_naming_the_field(server, body, param, says):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_openapi_lists_the_constraint_and_tool_fields(server):
    spec = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    paths = spec["paths"]
    chat = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
    completion = paths["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
    constraint_fields = {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                         "guided_grammar"}
    assert constraint_fields <= set(chat) and constraint_fields <= set(completion)
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(chat)
    assert "tools" not in completion
    # Fields accepted only at values that change nothing are listed at those values; no others are accepted.
    body = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["additionalProperties"] is False
    assert {"anyOf": [{"enum": [False]}, {"type": "null"}]} == chat["store"] and "metadata" in chat


def test_a_constraint_the_engine_could_not_compile_is_a_400_naming_the_field():
    """The engine's compile pool ends a request whose constraint passed the front end's check but did not
    compile, or not in time: the server answers a 400 naming the request's field, not a 500."""
    import threading
    import time

    from pagedllm.engine.async_llm import RequestFailedError
    from pagedllm.entrypoints.openai.structured_request import Constraint, compile_failure, compile_failure_event
    from pagedllm.structured_output.compiler import GrammarCompiler
    from pagedllm.sampling_params import StructuredOutputsParams

    release = threading.Event()
    slow = GrammarCompiler(lambda: release.wait(10) and None, vocab_size=10, timeout_s=1.0)
    params = StructuredOutputsParams(json=WEATHER)
    try:
        key, _ = slow.submit(params)
        slow.expire(now=time.monotonic() + 5)  # past its deadline
        late = RequestFailedError(str(slow.lookup(key).exception(timeout=5)))
    finally:
        release.set()
        slow.shutdown()
    no_tokenizer = GrammarCompiler(lambda: None, vocab_size=10)
    try:
        key, fut = no_tokenizer.submit(params)
        unservable = RequestFailedError(str(fut.exception(timeout=10)))
    finally:
        no_tokenizer.shutdown()

    fmt = Constraint(params, "response_format.json_schema.schema")
    err = compile_failure(late, fmt)
    assert err.status == 400 and err.param == "response_format" and "longer than 1 s" in err.message
    assert compile_failure(unservable, Constraint(params, "guided_json")).param == "guided_json"
    event = json.loads(compile_failure_event(late, Constraint(params, "tools")).removeprefix("data: "))
    assert event["error"]["param"] == "tools" and event["error"]["type"] == "invalid_request_error"
    # A token the mask let through is the engine's fault: still a 500; and without a constraint, nothing.
    assert compile_failure(RequestFailedError("the sampled token 7 does not fit structured_outputs"), fmt) is None
    assert compile_failure(late, None) is None
