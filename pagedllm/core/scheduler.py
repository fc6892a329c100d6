"""Scheduler: each step, a token budget split over running requests first, then waiting prompts (chunked)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pagedllm.core.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # cumulative
    prefix_cache_queries: int = 0  # cumulative tokens
    prefix_cache_hits: int = 0  # cumulative tokens


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
    ) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size, cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished since the last schedule(): the runner is told once, then forgets them.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Request id -> batches in flight that hold it (counted only with several batches in flight).
        self.in_flight: dict[str, int] = {}

    # ---- requests in and out -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(
        self, request_ids: str | list[str], status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        """Ends requests from outside the step (abort, or a stop string found by the detokenizer)."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for rid in ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            req.stop_reason = stop_reason
            self._free(req)

    def fail_requests(self, request_ids: list[str], reasons: str | dict[str, str]) -> list[EngineCoreOutput]:
        """Ends live requests with an error (one reason for all, or one per id); returns their final outputs."""
        outputs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            reason = reasons if isinstance(reasons, str) else reasons[rid]
            self.finish_requests(rid, RequestStatus.FINISHED_ERROR, reason)
            outputs.append(EngineCoreOutput(rid, [], finish_reason=req.finish_reason, stop_reason=reason))
        return outputs

    def recover_from_failed_step(self, failed_ids: set[str], reason: str) -> list[EngineCoreOutput]:
        """After a step that raised: ends the requests it computed with an error, sends every other running
        request back to the queue to be recomputed (the runner has dropped all its state), and forgets the
        prefix cache, whose blocks may hold what the failed step half wrote. Returns the final outputs."""
        outputs = self.fail_requests([rid for rid in self.requests if rid in failed_ids], reason)
        for req in reversed(self.running):
            self._preempt(req)
        self.running.clear()
        for req in self.waiting:
            req.num_pending_tokens = 0  # no step in flight will deliver them now
        self.kv_cache_manager.reset_prefix_cache()
        self.in_flight.clear()
        return outputs

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: set[str] = set()
        kv = self.kv_cache_manager
        # With several batches in flight, each takes its share of the requests: one batch holding them
        # all would leave every other pipeline stage idle while it passes through.
        batches = self.config.max_concurrent_batches
        max_reqs = -(-(len(self.running) + len(self.waiting)) // batches)

        # Running requests first, oldest first: each gets its next token or its next prompt chunk.
        i = 0
        while i < len(self.running) and budget > 0 and len(num_scheduled) < max_reqs:
            req = self.running[i]
            if req.request_id in self.in_flight:
                i += 1  # in a batch still in flight: never in two at once
                continue
            # Tokens sampled by a step still in flight count as known: the runner feeds them from the
            # device. A request whose pending token is certain to end it gets no further step.
            num_known = req.num_tokens + req.num_pending_tokens
            if req.num_pending_tokens and self._ends_by_length(req, num_known):
                i += 1
                continue
            num_new = min(num_known - req.num_computed_tokens, budget)
            num_new = min(num_new, self.max_model_len - req.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            new_blocks = kv.allocate_slots(req, num_new)
            while new_blocks is None:
                # Out of blocks: preempt the newest running request (recompute later) and retry.
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is req:
                    break
                new_blocks = kv.allocate_slots(req, num_new)
            if new_blocks is None:
                break
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append([b.block_id for b in new_blocks])
            cached.num_computed_tokens.append(req.num_computed_tokens)
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            i += 1

        # Then waiting requests, first come first served; none while this step had to preempt.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(num_scheduled) < max_reqs
        ):
            req = self.waiting[0]
            if req.num_pending_tokens or req.request_id in self.in_flight:
                break  # preempted while a step still computes it: resume once that step lands
            hits, num_hit_tokens = kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            new_blocks = kv.allocate_slots(req, num_new, hits)
            if new_blocks is None:
                break
            kv.record_prefix_cache_stats(req, num_hit_tokens)
            self.waiting.popleft()
            req.num_computed_tokens = num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            new_reqs.append(
                NewRequestData(
                    req_id=req.request_id,
                    prompt_token_ids=req.prompt_token_ids,
                    output_token_ids=list(req.output_token_ids),
                    sampling_params=req.sampling_params,
                    seed=req.seed,
                    block_ids=kv.get_block_ids(req.request_id),
                    num_computed_tokens=num_hit_tokens,
                )
            )
            num_scheduled[req.request_id] = num_new
            budget -= num_new

        # The step will compute these tokens; account for them now so the next schedule moves on.
        multi = batches > 1
        for rid, n in num_scheduled.items():
            if multi:
                self.in_flight[rid] = self.in_flight.get(rid, 0) + 1
            req = self.requests[rid]
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens + req.num_pending_tokens:
                req.num_pending_tokens += 1  # the step ends at the last known token: it samples
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
        )
        self.finished_req_ids = set()
        return out

    def _preempt(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Appends sampled tokens, applies stop conditions, frees finished requests."""
        for rid in scheduler_output.num_scheduled_tokens:
            left = self.in_flight.pop(rid, 0) - 1
            if left > 0:
                self.in_flight[rid] = left
        outputs = self.fail_requests(list(runner_output.errors), runner_output.errors) if runner_output.errors else []
        for rid, token_ids in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            req = self.requests.get(rid)
            if req is None:  # aborted, failed, or finished by an earlier step, while this one ran
                continue
            if token_ids:
                req.num_pending_tokens -= 1
            was_running = req.status == RequestStatus.RUNNING
            new_ids: list[int] = []
            for tok in token_ids:
                req.append_output_token_ids([tok])
                new_ids.append(tok)
                if self._check_stop(req, tok):
                    break
            prompt_lp = runner_output.prompt_logprobs.get(rid)
            if not new_ids and prompt_lp is None:
                continue
            lp = runner_output.logprobs.get(rid)
            if lp is not None and len(new_ids) < len(lp.ranks):
                lp = type(lp)(lp.token_ids[: len(new_ids)], lp.logprobs[: len(new_ids)], lp.ranks[: len(new_ids)])
            outputs.append(
                EngineCoreOutput(
                    req_id=rid,
                    new_token_ids=new_ids,
                    new_logprobs=lp,
                    new_prompt_logprobs=prompt_lp,
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                )
            )
            if req.is_finished:
                # A request preempted while this step ran waits in the queue, not in running.
                (self.running if was_running else self.waiting).remove(req)
                self._free(req)
        return outputs

    def _ends_by_length(self, req: Request, num_known: int) -> bool:
        """True when a request with ``num_known`` tokens (pending ones included) stops on length."""
        return (
            req.max_tokens is not None and num_known - req.num_prompt_tokens >= req.max_tokens
        ) or num_known >= self.max_model_len

    def _check_stop(self, req: Request, token: int) -> bool:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
                return True
            if not params.ignore_eos and token in req.eos_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
        if (req.max_tokens is not None and req.num_output_tokens >= req.max_tokens) or (
            req.num_tokens >= self.max_model_len
        ):
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def make_stats(self) -> SchedulerStats:
        st = self.kv_cache_manager.stats
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage(),
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=st.queries,
            prefix_cache_hits=st.hits,
        )
