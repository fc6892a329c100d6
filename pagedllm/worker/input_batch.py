"""Runner-side request state and the flattening of one SchedulerOutput into model inputs."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]


@dataclass
class BatchInputs:
    """Host-side arrays for one step, in the order of ``req_ids``."""

    req_ids: list[str]
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    block_table: np.ndarray  # [B, max_blocks] int32
    # Requests whose step ends at the last known token, so the sampled token is kept.
    sampling_mask: list[bool] = field(default_factory=list)


class InputBatch:
    """Holds every scheduled request's state between steps and builds each step's inputs."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.requests: dict[str, CachedRequestState] = {}

    def update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.requests[nr.req_id] = CachedRequestState(
                req_id=nr.req_id,
                prompt_token_ids=nr.prompt_token_ids,
                output_token_ids=list(nr.output_token_ids),
                sampling_params=nr.sampling_params,
                seed=nr.seed,
                block_ids=list(nr.block_ids),
                num_computed_tokens=nr.num_computed_tokens,
            )
        cr = so.scheduled_cached_reqs
        for rid, new_blocks, num_computed in zip(cr.req_ids, cr.new_block_ids, cr.num_computed_tokens):
            st = self.requests[rid]
            st.block_ids.extend(new_blocks)
            st.num_computed_tokens = num_computed

    def prepare(self, so: SchedulerOutput) -> BatchInputs:
        req_ids = list(so.num_scheduled_tokens)
        num_reqs = len(req_ids)
        bs = self.block_size
        total = so.total_num_scheduled_tokens
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        seq_lens = np.empty(num_reqs, dtype=np.int32)
        max_blocks = max(len(self.requests[r].block_ids) for r in req_ids)
        block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
        sampling_mask = []
        off = 0
        for i, rid in enumerate(req_ids):
            st = self.requests[rid]
            n = so.num_scheduled_tokens[rid]
            start = st.num_computed_tokens
            input_ids[off : off + n] = st.token_slice(start, start + n)
            positions[off : off + n] = np.arange(start, start + n)
            block_table[i, : len(st.block_ids)] = st.block_ids
            seq_lens[i] = start + n
            off += n
            query_start_loc[i + 1] = off
            sampling_mask.append(start + n >= st.num_tokens)
        # slot = block_table[req, pos // bs] * bs + pos % bs, done for all tokens at once.
        req_of_token = np.repeat(np.arange(num_reqs), np.diff(query_start_loc))
        slot_mapping = block_table[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        return BatchInputs(
            req_ids=req_ids,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            sampling_mask=sampling_mask,
        )
