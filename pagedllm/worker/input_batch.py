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
        # Python lists first, one numpy conversion each after: per-row numpy writes cost more than
        # the work itself at a few hundred decode requests per step.
        tokens: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        flat_blocks: list[int] = []
        num_blocks: list[int] = []
        sampling_mask: list[bool] = []
        for rid in req_ids:
            st = self.requests[rid]
            n = so.num_scheduled_tokens[rid]
            start = st.num_computed_tokens
            if n == 1 and start == st.num_tokens - 1:
                tokens.append(st.output_token_ids[-1] if st.output_token_ids else st.prompt_token_ids[-1])
            else:
                tokens.extend(st.token_slice(start, start + n))
            starts.append(start)
            lens.append(n)
            flat_blocks.extend(st.block_ids)
            num_blocks.append(len(st.block_ids))
            sampling_mask.append(start + n >= st.num_tokens)
        lens_np = np.array(lens, dtype=np.int32)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(lens_np, out=query_start_loc[1:])
        starts_np = np.array(starts, dtype=np.int64)
        total = int(query_start_loc[-1])
        req_of_token = np.repeat(np.arange(num_reqs), lens_np)
        positions = starts_np[req_of_token] + (np.arange(total) - query_start_loc[:-1][req_of_token])
        nb = np.array(num_blocks, dtype=np.int64)
        block_table = np.zeros((num_reqs, int(nb.max())), dtype=np.int32)
        row_of_block = np.repeat(np.arange(num_reqs), nb)
        col_of_block = np.arange(len(flat_blocks)) - np.repeat(np.cumsum(nb) - nb, nb)
        block_table[row_of_block, col_of_block] = flat_blocks
        # slot = block_table[req, pos // bs] * bs + pos % bs, for all tokens at once.
        slot_mapping = block_table[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        return BatchInputs(
            req_ids=req_ids,
            input_ids=np.array(tokens, dtype=np.int64),
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=(starts_np + lens_np).astype(np.int32),
            block_table=block_table,
            sampling_mask=sampling_mask,
        )
