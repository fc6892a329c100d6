"""/v1/chat/completions: messages (and tools) rendered by the chat template (in a bounded sandbox, off the
event loop), answered whole or streamed, with tool calls and reasoning read out of the output."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from pagedllm.engine.async_llm import EngineDeadError, RequestFailedError
from pagedllm.entrypoints.openai.blocking_pool import run_blocking
from pagedllm.entrypoints.openai.chat_outputs import ChoiceReader
from pagedllm.entrypoints.openai.chat_render import TemplateLimitError, render_chat
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
    PromptTokensDetails,
    Usage,
)
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningParser
from pagedllm.entrypoints.openai.structured_request import (
    Constraint,
    compile_failure,
    compile_failure_event,
    name_engine_error,
    one_constraint,
    request_constraints,
)
from pagedllm.entrypoints.openai.tool_calling import ToolPlan, plan_tools
from pagedllm.entrypoints.openai.tool_parsers import ToolParser
from pagedllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    Prompt,
    ServerSettings,
    StreamingResult,
    merge_streams,
    random_id,
    request_failed,
    sse_chunk,
    stream_failure,
    top_entries,
)
from pagedllm.outputs import Logprob


@dataclass
class _ChoiceState:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def _tool_call_arguments(d: dict[str, Any], where: str) -> None:
    """An assistant message's tool-call arguments as objects: OpenAI sends them as JSON text, and chat
    templates (Llama 3's, Qwen3's) write them out with tojson."""
    calls = d.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be a list of tool calls", param="messages")
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}.tool_calls[{i}] needs a function with a name", param="messages")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise bad_request(f"{where}.tool_calls[{i}].function.arguments is not JSON: {e}", param="messages") from None


def _message_dict(m: ChatMessage, where: str = "messages") -> dict[str, Any]:
    d = m.model_dump(exclude_none=True)
    _tool_call_arguments(d, where)
    if isinstance(m.content, list):
        # OpenAI content parts: only text parts can reach a text-only model.
        parts = []
        for part in m.content:
            if part.get("type", "text") != "text":
                raise bad_request(f"content part type {part.get('type')!r} is not supported", param="messages")
            text = part.get("text", "")
            if not isinstance(text, str):
                raise bad_request(f"the text of a content part must be a string, got {type(text).__name__}", param="messages")
            parts.append(text)
        d["content"] = "".join(parts)
    elif m.content is None:
        d["content"] = ""
    return d


# Variables the server itself hands the template; chat_template_kwargs may not replace them.
_RESERVED_TEMPLATE_VARS = ("messages", "add_generation_prompt", "tools", "documents")


def _template_param(request_template: str | None) -> str:
    return "chat_template" if request_template is not None else "messages"


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine: Any,
        settings: ServerSettings,
        chat_template: str | None = None,
        trust_request_chat_template: bool = False,
        auto_tool_parser: ToolParser | None = None,
        reasoning_parser: ReasoningParser | None = None,
    ) -> None:
        super().__init__(engine, settings)
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        self.auto_tool_parser = auto_tool_parser  # set only with --enable-auto-tool-choice
        self.reasoning_parser = reasoning_parser

    async def render(
        self,
        messages: list[ChatMessage],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> Prompt:
        """The conversation as prompt text and token ids (the template supplies special tokens)."""
        if self.tokenizer is None:
            raise bad_request("chat needs a tokenizer; this server runs with --skip-tokenizer-init", param="messages")
        if not messages:
            raise bad_request("messages must not be empty", param="messages")
        if chat_template is not None and not self.trust_request_chat_template:
            raise bad_request(
                "chat_template in a request is refused: a template is code the server would run; start the "
                "server with --trust-request-chat-template to accept templates from clients",
                param="chat_template",
            )
        for name in _RESERVED_TEMPLATE_VARS:
            if name in (template_kwargs or {}):
                raise bad_request(f"chat_template_kwargs may not set {name!r}: the server sets it", param="chat_template_kwargs")
        conversation = [_message_dict(m, f"messages[{i}]") for i, m in enumerate(messages)]
        try:
            return await run_blocking(
                self._render_and_encode, conversation, chat_template, add_generation_prompt, continue_final_message,
                template_kwargs or {}, tools,
            )
        except TemplateLimitError as e:
            raise bad_request(f"the chat template was stopped: {e}", param=_template_param(chat_template)) from None
        except OpenAIError:
            raise
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault (or a missing template)
            raise bad_request(f"the chat template could not be applied: {type(e).__name__}: {e}",
                              param=_template_param(chat_template)) from None

    def _render_and_encode(
        self, conversation: list[dict[str, Any]], chat_template: str | None, add_generation_prompt: bool,
        continue_final_message: bool, template_kwargs: dict[str, Any], tools: list[dict[str, Any]] | None = None,
    ) -> Prompt:
        source = self.tokenizer.get_chat_template(chat_template or self.chat_template, None)
        # Like transformers: the special tokens (bos_token, ...) first, the request's variables over them.
        variables = {**self.tokenizer.special_tokens_map, **template_kwargs}
        text = render_chat(
            source, conversation, variables,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tools=tools,
        )
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return Prompt(text, list(ids))

    async def create_chat_completion(self, req: ChatCompletionRequest) -> ChatCompletionResponse | StreamingResult:
        self.check_model(req.model)
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        k = (req.top_logprobs or 0) if req.logprobs else None
        plan = plan_tools(req, self.auto_tool_parser)
        constraint = one_constraint(req, request_constraints(req) + ([plan.constraint] if plan.constraint else []))
        # With thinking turned off in the template (Qwen3's enable_thinking), the output holds no reasoning.
        thinking = (req.chat_template_kwargs or {}).get("enable_thinking") is not False
        reasoning = self.reasoning_parser if thinking else None
        if constraint and reasoning is None:
            constraint.params.after_reasoning = False
        params = self.sampling_params(req, max_tokens, k, rename={"logprobs": "top_logprobs", "max_tokens": max_param},
                                      structured_outputs=constraint.params if constraint else None)
        if plan.parser is not None and plan.parser.needs_special_tokens:
            params.skip_special_tokens = False  # the parser's markers are special tokens
        prompt = await self.render(
            req.messages, req.chat_template, req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs,
            plan.tools,
        )
        self.check_context(len(prompt.token_ids), max_tokens, "messages", max_param)
        request_id = req.request_id or random_id("chatcmpl")
        try:
            streams = self.open_streams(request_id, [prompt], params, prompt_param="messages")
        except OpenAIError as e:
            raise name_engine_error(e, constraint) from None
        if req.stream:
            return StreamingResult(self._stream(req, request_id, prompt, streams, k, plan, reasoning, constraint), streams)
        return await self._full(req, request_id, prompt, streams, k, plan, reasoning, constraint)

    def _logprobs(self, token_ids: list[int], lps: list[dict[int, Logprob]], k: int) -> list[ChatTokenLogprob]:
        out = []
        for tok, pos in zip(token_ids, lps):
            chosen = pos.get(tok)
            text = self.token_text(tok)
            top = []
            for t, lp in top_entries(pos, k):
                tt = self.token_text(t)
                top.append(ChatTopLogprob(token=tt, logprob=lp.logprob, bytes=list(tt.encode("utf-8"))))
            out.append(
                ChatTokenLogprob(
                    token=text,
                    logprob=chosen.logprob if chosen is not None else float("-inf"),
                    bytes=list(text.encode("utf-8")),
                    top_logprobs=top,
                )
            )
        return out

    def _usage(self, prompt: Prompt, num_completion: int, cached: int) -> Usage:
        n = len(prompt.token_ids)
        return Usage(
            prompt_tokens=n,
            completion_tokens=num_completion,
            total_tokens=n + num_completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    async def _full(self, req, request_id: str, prompt: Prompt, streams, k: int | None, plan: ToolPlan,
                    reasoning: ReasoningParser | None, constraint: Constraint | None = None) -> ChatCompletionResponse:
        states = [_ChoiceState() for _ in range(req.n)]
        cached = 0
        try:
            async for _, out in merge_streams(streams):
                cached = out.num_cached_tokens
                for c in out.outputs:
                    st = states[c.index]
                    st.text.append(c.text)
                    st.num_tokens += len(c.token_ids)
                    if k is not None and c.logprobs:
                        st.logprobs.extend(self._logprobs(c.token_ids, c.logprobs, k))
                    if c.finish_reason is not None:
                        st.finish_reason, st.stop_reason = c.finish_reason, c.stop_reason
        except EngineDeadError as e:
            raise OpenAIError(500, f"The engine died while serving the request: {e}", code="engine_dead") from None
        except RequestFailedError as e:
            raise compile_failure(e, constraint) or request_failed(e) from None
        choices = []
        for i, st in enumerate(states):
            reader = ChoiceReader(plan, reasoning)
            message = reader.message("".join(st.text))
            choices.append(ChatCompletionChoice(
                index=i,
                message=message,
                logprobs=ChatChoiceLogprobs(content=st.logprobs) if k is not None else None,
                finish_reason=reader.finish_reason(st.finish_reason),
                stop_reason=st.stop_reason,
            ))
        usage = self._usage(prompt, sum(st.num_tokens for st in states), cached)
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)

    async def _stream(self, req, request_id: str, prompt: Prompt, streams, k: int | None, plan: ToolPlan,
                    reasoning: ReasoningParser | None, constraint: Constraint | None = None) -> AsyncIterator[str]:
        def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> str:
            return sse_chunk(ChatCompletionStreamResponse(id=request_id, model=self.model_name, choices=choices, usage=usage))

        states = [_ChoiceState() for _ in range(req.n)]
        readers = [ChoiceReader(plan, reasoning) for _ in range(req.n)]
        cached = 0
        try:
            for i in range(req.n):
                yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            async for _, out in merge_streams(streams):
                cached = out.num_cached_tokens
                for c in out.outputs:
                    st = states[c.index]
                    if st.finish_reason is not None:
                        continue  # later DELTA outputs repeat an earlier finish_reason
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    st.num_tokens += len(c.token_ids)
                    st.finish_reason = c.finish_reason
                    lp = None
                    if k is not None and c.logprobs is not None:
                        lp = ChatChoiceLogprobs(content=self._logprobs(c.token_ids, c.logprobs, k))
                    reader = readers[c.index]
                    delta = reader.delta(c.text, final=c.finish_reason is not None)
                    if delta == DeltaMessage() and lp is None and c.finish_reason is None:
                        continue  # held back (a marker being written)
                    yield chunk(
                        [
                            ChatStreamChoice(
                                index=c.index,
                                delta=delta,
                                logprobs=lp,
                                finish_reason=reader.finish_reason(c.finish_reason),
                                stop_reason=c.stop_reason if c.finish_reason is not None else None,
                            )
                        ]
                    )
            if req.stream_options is not None and req.stream_options.include_usage:
                yield chunk([], self._usage(prompt, sum(st.num_tokens for st in states), cached))
        except Exception as e:  # noqa: BLE001 - the headers are sent: the error goes in the stream
            yield compile_failure_event(e, constraint) or stream_failure(e, "/v1/chat/completions (stream)")
        yield "data: [DONE]\n\n"
