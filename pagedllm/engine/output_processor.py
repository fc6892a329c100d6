"""OutputProcessor: engine-core token outputs -> RequestOutputs (text, stop strings, logprobs, n > 1)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.scheduler_output import EngineCoreOutput, LogprobsLists
from pagedllm.engine.processor import ProcessedRequest
from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs


class OutputKind(enum.Enum):
    FINAL_ONLY = "final"  # one RequestOutput when everything is done (LLM.generate)
    CUMULATIVE = "cumulative"  # every step, the whole text so far
    DELTA = "delta"  # every step, only what is new (streaming servers)


@dataclass
class _ChildState:
    index: int
    detokenizer: Any | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # for DELTA outputs
    sent_logprobs: int = 0


class _RequestState:
    def __init__(
        self, pr: ProcessedRequest, tokenizer: Any | None, kind: OutputKind, special_ids: frozenset[int] | None
    ) -> None:
        self.request_id = pr.request_id
        self.prompt = pr.prompt
        self.prompt_token_ids = pr.prompt_token_ids
        self.params = pr.params
        self.kind = kind
        detok = tokenizer is not None and pr.params.detokenize
        if detok:
            from pagedllm.engine.detokenizer import IncrementalDetokenizer
        want_lp = pr.params.logprobs is not None
        self.children = {
            r.request_id: _ChildState(
                index=i,
                detokenizer=(
                    IncrementalDetokenizer(tokenizer, pr.prompt_token_ids, pr.params, special_ids) if detok else None
                ),
                logprobs=[] if want_lp else None,
                cumulative_logprob=0.0 if want_lp else None,
            )
            for i, r in enumerate(pr.children)
        }
        self.tokenizer = tokenizer
        self.prompt_logprobs: PromptLogprobs | None = [None] if pr.params.prompt_logprobs is not None else None
        self.num_cached_tokens = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


def _decode(tokenizer: Any | None, tok: int) -> str | None:
    return None if tokenizer is None else tokenizer.decode([tok])


def _logprob_dicts(lp: LogprobsLists, decode) -> list[dict[int, Logprob]]:
    """Per position: the chosen token (with its true rank) plus the top-k (ranks 1..k)."""
    out = []
    for ids, vals, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
        d = {ids[0]: Logprob(vals[0], rank, decode(ids[0]))}
        for r, (t, v) in enumerate(zip(ids[1:], vals[1:]), start=1):
            if t not in d:
                d[t] = Logprob(v, r, decode(t))
        out.append(d)
    return out


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        # Scanning the tokenizer's added tokens costs ~0.1-0.4 ms: once here, not per request.
        self.special_ids = None
        if tokenizer is not None:
            from pagedllm.engine.detokenizer import special_token_ids

            self.special_ids = special_token_ids(tokenizer)
        self.states: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(self, pr: ProcessedRequest, kind: OutputKind = OutputKind.FINAL_ONLY) -> None:
        state = _RequestState(pr, self.tokenizer, kind, self.special_ids)
        self.states[pr.request_id] = state
        for r in pr.children:
            self.child_to_parent[r.request_id] = pr.request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forgets parents; returns their children's ids for the engine core to abort."""
        children = []
        for rid in request_ids:
            st = self.states.pop(rid, None)
            if st is None:
                continue
            for cid in st.children:
                self.child_to_parent.pop(cid, None)
                children.append(cid)
        return children

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Returns the RequestOutputs to hand out now and (child id, stop string) pairs to stop in the core."""
        touched: dict[str, _RequestState] = {}
        stops: list[tuple[str, str]] = []
        for out in outputs:
            parent_id = self.child_to_parent.get(out.req_id)
            if parent_id is None:
                continue
            st = self.states[parent_id]
            child = st.children[out.req_id]
            if child.finish_reason is not None:  # already ended by a stop string
                continue
            if out.new_prompt_logprobs is not None and st.prompt_logprobs is not None:
                st.prompt_logprobs.extend(_logprob_dicts(out.new_prompt_logprobs, self._decoder(st)))
            if out.new_token_ids and st.first_token_time is None:
                st.first_token_time = time.monotonic()
            st.num_cached_tokens = out.num_cached_tokens
            child.token_ids.extend(out.new_token_ids)
            if out.new_logprobs is not None and child.logprobs is not None:
                child.logprobs.extend(_logprob_dicts(out.new_logprobs, self._decoder(st)))
                child.cumulative_logprob += sum(v[0] for v in out.new_logprobs.logprobs)
            stop_str = child.detokenizer.update(out.new_token_ids) if child.detokenizer else None
            if stop_str is not None:
                child.finish_reason, child.stop_reason = "stop", stop_str
                if not out.finished:
                    stops.append((out.req_id, stop_str))
            elif out.finished:
                child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
            touched[parent_id] = st
        results = []
        for pid, st in touched.items():
            if st.finished and st.finished_time is None:
                st.finished_time = time.monotonic()
            if st.kind is OutputKind.FINAL_ONLY and not st.finished:
                continue
            results.append(self._make_output(st))
            if st.finished:
                del self.states[pid]
                for cid in st.children:
                    self.child_to_parent.pop(cid, None)
        return results, stops

    def _decoder(self, st: _RequestState):
        tok = self.tokenizer if st.params.detokenize else None
        return lambda t: _decode(tok, t)

    def _make_output(self, st: _RequestState) -> RequestOutput:
        delta = st.kind is OutputKind.DELTA
        completions = []
        for child in sorted(st.children.values(), key=lambda c: c.index):
            finished = child.finish_reason is not None
            if child.detokenizer is not None:
                text = child.detokenizer.get_next_output_text(finished, delta)
            else:
                text = ""
            token_ids, logprobs = child.token_ids, child.logprobs
            if delta:
                token_ids = token_ids[child.sent_tokens :]
                child.sent_tokens = len(child.token_ids)
                if logprobs is not None:
                    logprobs = logprobs[child.sent_logprobs :]
                    child.sent_logprobs = len(child.logprobs)
            else:
                token_ids = list(token_ids)
            completions.append(
                CompletionOutput(
                    index=child.index,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=child.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                )
            )
        return RequestOutput(
            request_id=st.request_id,
            prompt=st.prompt,
            prompt_token_ids=st.prompt_token_ids,
            prompt_logprobs=st.prompt_logprobs,
            outputs=completions,
            finished=st.finished,
            num_cached_tokens=st.num_cached_tokens,
            metrics={
                "arrival_time": st.arrival_time, "first_token_time": st.first_token_time,
                "finished_time": st.finished_time,
            },
        )
