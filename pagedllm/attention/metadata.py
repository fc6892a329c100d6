"""AttentionMetadata: the per-step description of a flat, mixed batch over the paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """One step's batch. Requests are laid out back to back in the flat token dimension.

    Request i owns query tokens ``query_start_loc[i]:query_start_loc[i+1]``; they sit at positions
    ``seq_lens[i] - query_len_i .. seq_lens[i] - 1`` of its sequence, so a prompt chunk attends to its
    cached prefix plus itself causally and a decode token (query_len 1) attends to everything.
    """

    num_actual_tokens: int  # T: tokens in this step
    num_reqs: int  # B
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [B + 1] int32, on the model's device
    seq_lens: torch.Tensor  # [B] int32, context + new tokens per request, on the model's device
    block_table: torch.Tensor  # [B, max_blocks_per_req] int32, physical block ids, on the model's device
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset for each new token
    # Host copies, so reference paths can slice per request without a device sync.
    query_start_loc_cpu: list[int]  # [B + 1]
    seq_lens_cpu: list[int]  # [B]
    # [B] int32 on the model's device, or None: the order in which a pure-decode launch takes its
    # requests (longest context first balances the launch); fast backends may use it, results are the same.
    decode_order: torch.Tensor | None = None
    # What a backend derives from this step's batch alone (gather indices, masks), computed by the
    # first layer and reused by the others; keyed by the backend. Not part of the batch description.
    step_cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def query_lens_cpu(self) -> list[int]:
        q = self.query_start_loc_cpu
        return [q[i + 1] - q[i] for i in range(self.num_reqs)]
