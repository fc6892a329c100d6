"""Runner-side request state and the flattening of one SchedulerOutput into host-side model inputs."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.sampling_params import SamplingParams


def is_plain_greedy(p: SamplingParams) -> bool:
    """True when the sampler would reduce to a bare argmax: no processing, no logprobs, no randomness."""
    return (
        p.greedy
        and p.logprobs is None
        and not p.has_penalties
        and p.allowed_token_ids is None
        and not p.logit_bias
        and not (p.min_tokens > 0 and p.all_stop_token_ids)
    )


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    block_ids: list[int]
    num_computed_tokens: int
    row: int = -1  # this request's row in the persistent block table
    plain_greedy: bool = False
    # int64 copies of the token ids for penalties, which read every id of a request each step: the
    # prompt's made once, the outputs' extended by what each step appended (see token_arrays).
    _prompt_array: array | None = field(default=None, repr=False, compare=False)
    _output_array: array = field(default_factory=lambda: array("q"), repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_arrays(self) -> tuple[array, array]:
        """(prompt ids, output ids) as int64 arrays, kept in step with the lists at O(new tokens) a call."""
        if self._prompt_array is None:
            self._prompt_array = array("q", self.prompt_token_ids)
        out, n = self.output_token_ids, len(self._output_array)
        if n > len(out):  # never expected (outputs only grow); rebuild rather than trust a stale copy
            self._output_array, n = array("q"), 0
        if n < len(out):
            self._output_array.extend(out[n:])
        return self._prompt_array, self._output_array

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]


@dataclass
class BatchInputs:
    """Host-side arrays for one step, in the order of ``req_ids`` (B requests, T tokens)."""

    req_ids: list[str]
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    block_table: np.ndarray  # [B, W] int32, W = the most blocks any request of the step holds
    # Requests whose step ends at the last known token, so the sampled token is kept.
    sampling_mask: list[bool] = field(default_factory=list)
    logits_indices: np.ndarray | None = None  # [S] int64: flat index of each sampled request's last token
    logits_reqs: np.ndarray | None = None  # [S] int64: index of each sampled request in the batch
    # Tokens the previous step is still sampling (asynchronous scheduling): their flat indices here,
    # and (set by the runner) the row of each in the previous step's sampled ids, to copy on the device.
    pending_dst: np.ndarray | None = None  # [P] int64
    pending_src: np.ndarray | None = None  # [P] int64
    pending_req_ids: list[str] = field(default_factory=list)
    max_query_len: int = 0
    max_seq_len: int = 0

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


class BlockTableRows:
    """A persistent host block table: each running request owns one row and only new blocks are written.

    Rebuilding a [B, W] table from Python lists every step costs O(B * W) interpreter work; with rows
    that persist, a step is one numpy gather of the scheduled rows.
    """

    def __init__(self, num_rows: int = 8, num_cols: int = 8) -> None:
        self.table = np.zeros((max(1, num_rows), max(1, num_cols)), dtype=np.int32)  # [rows, cols]
        self.num_blocks = np.zeros(max(1, num_rows), dtype=np.int64)  # [rows]
        self._free_rows = list(range(self.table.shape[0] - 1, -1, -1))  # popped from the end: low rows first

    def _grow(self, rows: int, cols: int) -> None:
        old_rows, old_cols = self.table.shape
        new_rows, new_cols = max(old_rows, rows), max(old_cols, cols)
        if (new_rows, new_cols) == (old_rows, old_cols):
            return
        if new_rows > old_rows:
            new_rows = max(new_rows, 2 * old_rows)
        if new_cols > old_cols:
            new_cols = max(new_cols, 2 * old_cols)
        table = np.zeros((new_rows, new_cols), dtype=np.int32)
        table[:old_rows, :old_cols] = self.table
        self.table = table
        num_blocks = np.zeros(new_rows, dtype=np.int64)
        num_blocks[:old_rows] = self.num_blocks
        self.num_blocks = num_blocks
        # New rows go below the old free ones, so low rows keep being reused first.
        self._free_rows = list(range(new_rows - 1, old_rows - 1, -1)) + self._free_rows

    def add(self, block_ids: list[int]) -> int:
        if not self._free_rows:
            self._grow(2 * self.table.shape[0], 0)
        row = self._free_rows.pop()
        self.num_blocks[row] = 0
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._grow(0, end)
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def free(self, row: int) -> None:
        # Zeroed so a later owner of the row never shows another request's blocks past its own.
        self.table[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:  # rows [B] -> [B, width] int32
        return self.table[rows, :width]


class InputBatch:
    """Holds every scheduled request's state between steps and builds each step's inputs."""

    def __init__(self, block_size: int, max_num_reqs: int = 8, max_blocks_per_req: int = 8) -> None:
        self.block_size = block_size
        self.requests: dict[str, CachedRequestState] = {}
        self.block_table = BlockTableRows(max_num_reqs, max_blocks_per_req)

    def remove(self, req_id: str) -> None:
        st = self.requests.pop(req_id, None)
        if st is not None:
            self.block_table.free(st.row)

    def update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.remove(rid)
        for nr in so.scheduled_new_reqs:
            # A resumed request starts over with a full block list; drop any stale row first.
            self.remove(nr.req_id)
            self.requests[nr.req_id] = CachedRequestState(
                req_id=nr.req_id,
                prompt_token_ids=nr.prompt_token_ids,
                output_token_ids=list(nr.output_token_ids),
                sampling_params=nr.sampling_params,
                seed=nr.seed,
                block_ids=list(nr.block_ids),
                num_computed_tokens=nr.num_computed_tokens,
                row=self.block_table.add(list(nr.block_ids)),
                plain_greedy=is_plain_greedy(nr.sampling_params),
            )
        cr = so.scheduled_cached_reqs
        table = self.block_table
        for rid, new_blocks, num_computed in zip(cr.req_ids, cr.new_block_ids, cr.num_computed_tokens):
            st = self.requests[rid]
            if new_blocks:
                st.block_ids.extend(new_blocks)
                table.append(st.row, new_blocks)
            st.num_computed_tokens = num_computed

    def prepare(self, so: SchedulerOutput) -> BatchInputs:
        req_ids = list(so.num_scheduled_tokens)
        num_reqs = len(req_ids)
        bs = self.block_size
        scheduled = so.num_scheduled_tokens
        requests = self.requests
        # Python lists first, one numpy conversion each after: per-row numpy writes cost more than
        # the work itself at a few hundred decode requests per step.
        tokens: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        rows: list[int] = []
        sampling_mask: list[bool] = []
        pending_dst: list[int] = []
        pending_req_ids: list[str] = []
        for rid in req_ids:
            st = requests[rid]
            n = scheduled[rid]
            start = st.num_computed_tokens
            num_tokens = len(st.prompt_token_ids) + len(st.output_token_ids)
            if start == num_tokens:
                # The step in flight is sampling this token; the runner copies it in on the device.
                if n != 1:
                    raise RuntimeError(f"request {rid!r}: {n} tokens scheduled past its {num_tokens} known ones")
                pending_dst.append(len(tokens))
                pending_req_ids.append(rid)
                tokens.append(0)
                num_tokens += 1
            elif n == 1 and start == num_tokens - 1:
                tokens.append(st.output_token_ids[-1] if st.output_token_ids else st.prompt_token_ids[-1])
            else:
                tokens.extend(st.token_slice(start, start + n))
            starts.append(start)
            lens.append(n)
            rows.append(st.row)
            sampling_mask.append(start + n >= num_tokens)
        lens_np = np.array(lens, dtype=np.int32)  # [B]
        starts_np = np.array(starts, dtype=np.int64)  # [B]
        rows_np = np.array(rows, dtype=np.int64)  # [B]
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)  # [B + 1]
        np.cumsum(lens_np, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        max_query_len = int(lens_np.max())
        if max_query_len == 1:
            # Pure decode: one token per request, at the request's next position.
            req_of_token = np.arange(num_reqs)
            positions = starts_np
        else:
            req_of_token = np.repeat(np.arange(num_reqs), lens_np)  # [T]
            positions = starts_np[req_of_token] + (np.arange(total) - query_start_loc[:-1][req_of_token])
        width = int(self.block_table.num_blocks[rows_np].max())
        block_table = self.block_table.gather(rows_np, width)  # [B, W]
        # slot = block_table[req, pos // bs] * bs + pos % bs, for all tokens at once.
        slot_mapping = block_table[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = (starts_np + lens_np).astype(np.int32)
        mask_np = np.array(sampling_mask, dtype=bool)
        return BatchInputs(
            req_ids=req_ids,
            input_ids=np.array(tokens, dtype=np.int64),
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            sampling_mask=sampling_mask,
            logits_indices=(query_start_loc[1:][mask_np] - 1).astype(np.int64),
            logits_reqs=np.flatnonzero(mask_np).astype(np.int64),
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
            pending_dst=np.array(pending_dst, dtype=np.int64),
            pending_req_ids=pending_req_ids,
        )
