"""What the completion and chat handlers share: model and admission checks, SamplingParams from a
request, the context-length check, opening and merging engine streams, and logprob lookups."""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError, RequestStream
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, error_body, from_value_error, internal_error_body
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

# Request fields that map one to one onto SamplingParams fields of the same name.
_DIRECT_FIELDS = (
    "n", "presence_penalty", "frequency_penalty", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "logit_bias", "allowed_token_ids",
)
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# Fields whose None means "the model's default" (generation_config.json), as in vLLM.
_DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")


@dataclass
class ServerSettings:
    served_model_names: list[str]
    max_n: int = 128
    max_waiting_requests: int | None = None
    retry_after_s: int = 1
    # Prompts times n: each is a sequence the engine schedules, and they are all added at once.
    max_sequences_per_request: int = 1024


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]


@dataclass
class StreamingResult:
    """A streamed answer: SSE lines, and the engine streams to close if the lines are never read."""

    content: AsyncIterator[str]
    streams: list[RequestStream]

    def close(self) -> None:
        for s in self.streams:
            s.close()


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.model_config.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.defaults = engine.processor.default_sampling_params()
        self.token_text = TokenTexts(self.tokenizer)

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    # ---- checks -----------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.settings.served_model_names:
            raise OpenAIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def check_engine(self) -> None:
        if self.engine.is_dead:
            raise OpenAIError(500, f"The engine is dead: {self.engine.dead_error}", code="engine_dead")

    def check_num_sequences(self, num_prompts: int, n: int) -> None:
        limit = self.settings.max_sequences_per_request
        if num_prompts > limit or (isinstance(n, int) and num_prompts * n > limit):
            raise bad_request(
                f"prompt holds {num_prompts} prompts and n is {n}: {num_prompts * n} sequences, more than the "
                f"{limit} one request may ask for",
                param="prompt",
            )

    def check_admission(self, num_new: int) -> None:
        """429 when the queue of accepted-but-not-started requests would exceed the limit."""
        limit = self.settings.max_waiting_requests
        if limit is None:
            return
        waiting = self.engine.num_unstarted_requests
        if waiting + num_new > limit:
            raise OpenAIError(
                429,
                f"Too many waiting requests ({waiting} waiting, limit {limit}); retry later.",
                code="too_many_waiting_requests",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str, max_param: str) -> None:
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens; at least one token must be left for the completion.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                f"in the completion). Reduce the prompt or {max_param}.",
                param=max_param,
                code="context_length_exceeded",
            )

    # ---- sampling ---------------------------------------------------------------------------------
    def sampling_params(
        self, req: Any, max_tokens: int | None, logprobs: int | None, rename: dict[str, str],
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        if not isinstance(req.n, int) or req.n > self.settings.max_n:
            raise bad_request(f"n must be at most {self.settings.max_n} (--max-n), got {req.n}", param="n")
        kwargs: dict[str, Any] = {name: getattr(req, name) for name in _DIRECT_FIELDS}
        for name in _DEFAULTED_FIELDS:
            value = getattr(req, name)
            kwargs[name] = getattr(self.defaults, name) if value is None else value
        kwargs["max_tokens"] = max_tokens
        kwargs["logprobs"] = logprobs
        fields = list(kwargs) + ["logprobs", "max_tokens"]
        for name, value in kwargs.items():
            # The engine core gets these as msgpack integers; larger ones could not even be sent.
            if isinstance(value, int) and not _INT64_MIN <= value <= _INT64_MAX:
                shown = rename.get(name, name)
                raise bad_request(f"{shown} must fit in a signed 64-bit integer, got {value}", param=shown)
        try:
            params = SamplingParams(**kwargs, structured_outputs=structured_outputs)
            params.verify_vocab(self.vocab_size)
        except (ValueError, TypeError) as e:
            raise from_value_error(ValueError(str(e)), fields, rename) from None
        return params

    # ---- engine streams ---------------------------------------------------------------------------
    def open_streams(
        self, request_id: str, prompts: list[Prompt], params: SamplingParams, prompt_param: str = "prompt"
    ) -> list[RequestStream]:
        self.check_engine()
        self.check_admission(len(prompts))
        streams: list[RequestStream] = []
        try:
            for i, p in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                prompt = {"prompt_token_ids": p.token_ids, "prompt": p.text}
                streams.append(self.engine.add_request(rid, prompt, params))
        except ValueError as e:
            for s in streams:
                s.close()
            err = from_value_error(e, [])
            if err.param == "prompt":
                err.param = prompt_param
            raise err from None
        except EngineDeadError as e:
            for s in streams:
                s.close()
            raise OpenAIError(500, f"The engine is dead: {e}", code="engine_dead") from None
        return streams


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they come; closes (aborts) them all on exit."""
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
                queue.put_nowait((i, done))
            except BaseException as e:  # noqa: BLE001 - handed to the reader
                queue.put_nowait((i, e))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for s in streams:
            s.close()


def top_entries(position: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The top-k alternatives of one position, best first (the chosen token is in the dict too,
    with its true rank, and appears here only if it is in the top k)."""
    ranked = [(t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= k]
    ranked.sort(key=lambda e: e[1].rank)
    return ranked[:k]


class TokenTexts:
    """The text of single tokens for logprobs, with the leading space a lone decode would drop
    (SentencePiece "▁word" decodes to "word" at the start of a text). Each token is decoded after a
    fixed anchor token and the anchor's text is cut off again; results are cached per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.anchor: list[int] = []
        self.anchor_text = ""
        if tokenizer is not None:
            ids = tokenizer.encode("a", add_special_tokens=False)
            if ids:
                self.anchor = [ids[-1]]
                self.anchor_text = tokenizer.decode(self.anchor)

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self._decode(token_id)
            self.cache[token_id] = text
        return text

    def _decode(self, token_id: int) -> str:
        tok = self.tokenizer
        if tok is None:
            return f"token_id:{token_id}"
        if self.anchor:
            both = tok.decode(self.anchor + [token_id])
            if both.startswith(self.anchor_text):
                return both[len(self.anchor_text):]
        return tok.decode([token_id])


# JSON leaves these raw, and SSE does not split on them, but line readers built on str.splitlines (httpx's
# aiter_lines among them) do: escaped, a generated NEL or line/paragraph separator cannot cut an event.
_SPLITLINES_ONLY = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_chunk(chunk: Any) -> str:
    """One server-sent event; a chunk without usage leaves the key out (as OpenAI does)."""
    exclude = {"usage"} if getattr(chunk, "usage", None) is None else None
    return f"data: {chunk.model_dump_json(exclude=exclude).translate(_SPLITLINES_ONLY)}\n\n"


def sse_error(status: int, message: str, code: str | None = None) -> str:
    return f"data: {json.dumps(error_body(status, message, code=code))}\n\n"


def request_failed(e: RequestFailedError) -> OpenAIError:
    """The engine ended this request alone (its sampling or its step failed); the others go on."""
    return OpenAIError(500, f"The engine could not complete this request: {e}", code="request_failed")


def stream_failure(e: Exception, where: str) -> str:
    """The error event that ends a stream which cannot go on, so that the client sees why before [DONE]."""
    if isinstance(e, EngineDeadError):
        return sse_error(500, f"The engine died while serving the request: {e}", code="engine_dead")
    if isinstance(e, RequestFailedError):
        err = request_failed(e)
        return sse_error(err.status, err.message, code=err.code)
    return f"data: {json.dumps(internal_error_body(e, where))}\n\n"
