"""The OpenAI-compatible wire format: every pydantic model of the server (requests, responses, chunks, errors).

Request models check types strictly (no `true` for an integer, no "0.5" for a number) and shapes;
value ranges are checked once, by SamplingParams, so the messages are the engine's own and name the
field. Unknown request fields are kept in `model_extra`, and unsupported_fields refuses each one that
would change the answer, by name, rather than ignore it.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_serializer


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


# Every stop string is searched for in the new text of every step, so their number and length are
# what one request may add to the work of each step.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096
_StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]
# Real chat templates are a few KiB; a request's template is compiled before it runs, so its size is bounded too.
MAX_TEMPLATE_CHARS = 256 << 10
_Template = Annotated[str, StringConstraints(max_length=MAX_TEMPLATE_CHARS)]


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Strict(BaseModel):
    """A nested request object whose every key is known: an unknown one is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", strict=True)


# ---- errors ---------------------------------------------------------------------------------------
class ErrorInfo(_Response):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[int, str]] = None


class ErrorResponse(_Response):
    error: ErrorInfo


# ---- shared ---------------------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool = False


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


# ---- structured outputs ---------------------------------------------------------------------------
class JsonSchemaFormat(_Strict):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[Union[dict[str, Any], bool]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` extra field: exactly one constraint."""

    json_: Optional[Union[str, dict[str, Any], bool]] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False


class _SamplingFields(_Request):
    """Fields both endpoints share: OpenAI's, then vLLM's extras."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    seed: Optional[int] = None
    stop: Optional[Union[_StopString, Annotated[list[_StopString], Field(max_length=MAX_STOP_STRINGS)]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM extras
    top_k: Optional[int] = None
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: Optional[list[int]] = None
    request_id: Optional[str] = None
    # structured outputs: OpenAI's, vLLM's, and vLLM's older guided_* names (one constraint per request)
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    guided_json: Optional[Union[str, dict[str, Any], bool]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None


# ---- /v1/completions ------------------------------------------------------------------------------
class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


# A stream chunk has the same shape as the response (OpenAI's "text_completion" object).
CompletionStreamResponse = CompletionResponse


# ---- /v1/chat/completions -------------------------------------------------------------------------
class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... reach the chat template as given

    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None


class FunctionDefinition(_Strict):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatTool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    # vLLM extras for the chat template
    chat_template: Optional[_Template] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: Optional[list[ChatTokenLogprob]] = None


class FunctionCallOut(_Response):
    name: str
    arguments: str


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCallOut]] = None


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class _Delta(_Response):
    """A stream delta carries only the keys it sets, as OpenAI's do (a tool call's later deltas are
    `{"index", "function": {"arguments"}}`)."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_Delta):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_Delta):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


class DeltaMessage(_Delta):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[Usage] = None


# ---- /v1/models, /tokenize, /detokenize, /version ---------------------------------------------------
class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: Optional[_Template] = None
    tools: Optional[list[ChatTool]] = None  # rendered with messages, as a chat request's are


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str
