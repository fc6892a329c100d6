"""Persistent step-input buffers: one pinned host staging area mirrored on the device, filled by one H2D copy.

Every array a step needs (token ids, positions, slot mapping, query starts, sequence lengths, the
block table, the longest-first request order, the rows and requests to sample, where to copy tokens the previous step is still sampling) is packed
back to back into one host buffer and sent to the device in a single non-blocking copy. The packing
depends only on (tokens, requests, block-table width, sampled rows, pending tokens), and the last two
come last, so a batch padded to a given (tokens, requests) shape always lands at the same device
addresses: that is what lets a CUDA graph captured once read every later step.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

from pagedllm.worker.input_batch import BatchInputs

# Sections start on this many bytes: wide, aligned loads in kernels, and the same pointer alignment
# (hence the same Triton specialisation) whatever the section sizes are.
_ALIGN = 64

# name, element type; the order is the packing order.
_SECTIONS: tuple[tuple[str, np.dtype], ...] = (
    ("input_ids", np.dtype(np.int64)),
    ("positions", np.dtype(np.int64)),
    ("slot_mapping", np.dtype(np.int64)),
    ("query_start_loc", np.dtype(np.int32)),
    ("seq_lens", np.dtype(np.int32)),
    ("block_table", np.dtype(np.int32)),
    ("decode_order", np.dtype(np.int32)),
    ("logits_indices", np.dtype(np.int64)),
    ("logits_reqs", np.dtype(np.int64)),
    ("pending_dst", np.dtype(np.int64)),
    ("pending_src", np.dtype(np.int64)),
)
_TORCH_DTYPES = MappingProxyType({np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32})


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def step_layout(
    num_tokens: int, num_reqs: int, block_width: int, num_logits: int, num_pending: int = 0
) -> tuple[dict[str, tuple[int, int]], int]:
    """Byte offset and element count of every section, and the bytes used in all."""
    counts = {
        "input_ids": num_tokens,
        "positions": num_tokens,
        "slot_mapping": num_tokens,
        "query_start_loc": num_reqs + 1,
        "seq_lens": num_reqs,
        "block_table": num_reqs * block_width,
        "decode_order": num_reqs,
        "logits_indices": num_logits,
        "logits_reqs": num_logits,
        "pending_dst": num_pending,
        "pending_src": num_pending,
    }
    layout: dict[str, tuple[int, int]] = {}
    offset = 0
    for name, dtype in _SECTIONS:
        layout[name] = (offset, counts[name])
        offset = _align(offset + counts[name] * dtype.itemsize)
    return layout, offset


@dataclass
class DeviceInputs:
    """Device views of one step's inputs (Tp tokens and Bp requests, padding included)."""

    input_ids: torch.Tensor  # [Tp] int64
    positions: torch.Tensor  # [Tp] int64
    slot_mapping: torch.Tensor  # [Tp] int64, -1 on padding tokens
    query_start_loc: torch.Tensor  # [Bp + 1] int32
    seq_lens: torch.Tensor  # [Bp] int32, 0 on padding requests
    block_table: torch.Tensor  # [Bp, W] int32
    decode_order: torch.Tensor  # [Bp] int32: requests by decreasing sequence length (padding last)
    logits_indices: torch.Tensor  # [S] int64
    logits_reqs: torch.Tensor  # [S] int64
    pending_dst: torch.Tensor  # [P] int64: input_ids rows to fill from the previous step's sampled ids
    pending_src: torch.Tensor  # [P] int64: rows of those sampled ids


class StepBuffers:
    """The staging area and its device mirror. On CPU the two are one buffer and nothing is copied."""

    def __init__(self, device: torch.device, max_tokens: int, max_reqs: int, max_blocks_per_req: int) -> None:
        self.device = device
        self.max_tokens = max_tokens
        self.max_reqs = max_reqs
        self.max_blocks_per_req = max_blocks_per_req
        _, capacity = step_layout(max_tokens, max_reqs, max_blocks_per_req, max_reqs, max_reqs)
        self.capacity = capacity
        on_gpu = device.type == "cuda"
        self.host = torch.zeros(capacity, dtype=torch.uint8, pin_memory=on_gpu)  # [capacity] bytes
        self._host_np = self.host.numpy()
        self.device_buf = torch.zeros(capacity, dtype=torch.uint8, device=device) if on_gpu else self.host
        # Set after each copy: the staging area may be rewritten only once the previous copy has read it.
        self._copy_done = torch.cuda.Event() if on_gpu else None

    def _host_view(self, layout: dict[str, tuple[int, int]], name: str, dtype: np.dtype) -> np.ndarray:
        offset, count = layout[name]
        return self._host_np[offset : offset + count * dtype.itemsize].view(dtype)

    def _device_views(self, layout: dict[str, tuple[int, int]], num_reqs: int, block_width: int) -> DeviceInputs:
        views = {}
        for name, dtype in _SECTIONS:
            offset, count = layout[name]
            views[name] = self.device_buf[offset : offset + count * dtype.itemsize].view(_TORCH_DTYPES[dtype])
        views["block_table"] = views["block_table"].view(num_reqs, block_width)
        return DeviceInputs(**views)

    def static_views(self, num_tokens: int, num_reqs: int) -> DeviceInputs:
        """Where a batch padded to ``num_tokens`` tokens and ``num_reqs`` requests lands (full-width block
        table, no sampled rows): the fixed addresses a CUDA graph of that shape reads."""
        layout, _ = step_layout(num_tokens, num_reqs, self.max_blocks_per_req, 0)
        return self._device_views(layout, num_reqs, self.max_blocks_per_req)

    def decode_views(self, num_reqs: int) -> DeviceInputs:
        """The static views of a pure-decode batch padded to ``num_reqs`` one-token requests."""
        return self.static_views(num_reqs, num_reqs)

    def upload(
        self,
        b: BatchInputs,
        num_reqs_padded: int | None = None,
        block_width: int | None = None,
        num_tokens_padded: int | None = None,
    ) -> DeviceInputs:
        """Packs ``b``, padded to ``num_reqs_padded`` requests and ``num_tokens_padded`` tokens, in one copy.

        Padding tokens have slot -1 (the cache write skips them) and padding requests sequence length 0
        (attention reads no key and writes zeros), so neither can disturb the real rows. With as many
        padding tokens as padding requests (a decode graph's batch) each padding request owns one token;
        otherwise the first one owns them all and the others none (a mixed graph's batch, whose request
        count is fixed while its token count is not).
        """
        num_reqs, num_tokens = b.num_reqs, b.num_tokens
        padded_reqs = num_reqs if num_reqs_padded is None else num_reqs_padded
        pad = padded_reqs - num_reqs
        padded_tokens = num_tokens + pad if num_tokens_padded is None else num_tokens_padded
        width = b.block_table.shape[1] if block_width is None else block_width
        num_logits = 0 if b.logits_indices is None else len(b.logits_indices)
        num_pending = 0 if b.pending_dst is None else len(b.pending_dst)
        if padded_tokens > num_tokens and pad == 0:
            raise ValueError(f"{padded_tokens - num_tokens} padding tokens need a padding request to own them")
        if (pad < 0 or padded_tokens < num_tokens or padded_tokens > self.max_tokens or padded_reqs > self.max_reqs
                or width > self.max_blocks_per_req):
            raise ValueError(
                f"step of {padded_tokens} tokens, {padded_reqs} requests, {width} blocks per request exceeds "
                f"the input buffers ({self.max_tokens}, {self.max_reqs}, {self.max_blocks_per_req})"
            )
        layout, used = step_layout(padded_tokens, padded_reqs, width, num_logits, num_pending)
        if self._copy_done is not None:
            self._copy_done.synchronize()

        def view(name: str, dtype: np.dtype) -> np.ndarray:
            return self._host_view(layout, name, dtype)

        i64, i32 = np.dtype(np.int64), np.dtype(np.int32)
        for name, src, fill in (
            ("input_ids", b.input_ids, 0),
            ("positions", b.positions, 0),
            ("slot_mapping", b.slot_mapping, -1),
        ):
            dst = view(name, i64)
            dst[:num_tokens] = src
            dst[num_tokens:] = fill
        qsl = view("query_start_loc", i32)
        qsl[: num_reqs + 1] = b.query_start_loc
        if padded_tokens - num_tokens == pad:
            qsl[num_reqs + 1 :] = np.arange(num_tokens + 1, padded_tokens + 1, dtype=np.int32)
        else:
            qsl[num_reqs + 1 :] = padded_tokens
        seq_lens = view("seq_lens", i32)
        seq_lens[:num_reqs] = b.seq_lens
        seq_lens[num_reqs:] = 0
        table = view("block_table", i32).reshape(padded_reqs, width)
        w = b.block_table.shape[1]
        table[:num_reqs, :w] = b.block_table
        table[:num_reqs, w:] = 0
        table[num_reqs:] = 0
        # Decode attention takes requests in this order: the longest contexts start first, so the
        # short ones fill the launch's tail instead of one long request finishing alone.
        view("decode_order", i32)[:] = np.argsort(-seq_lens, kind="stable")
        if num_logits:
            view("logits_indices", i64)[:] = b.logits_indices
            view("logits_reqs", i64)[:] = b.logits_reqs
        if num_pending:
            view("pending_dst", i64)[:] = b.pending_dst
            view("pending_src", i64)[:] = b.pending_src

        if self._copy_done is not None:
            self.device_buf[:used].copy_(self.host[:used], non_blocking=True)
            self._copy_done.record()
        return self._device_views(layout, padded_reqs, width)

    def upload_dummy(self, num_tokens: int, num_reqs: int) -> DeviceInputs:
        """Fills the static views of (``num_tokens``, ``num_reqs``) with padding only (graph warm-up, capture)."""
        empty = BatchInputs(
            req_ids=[],
            input_ids=np.zeros(0, dtype=np.int64),
            positions=np.zeros(0, dtype=np.int64),
            slot_mapping=np.zeros(0, dtype=np.int64),
            query_start_loc=np.zeros(1, dtype=np.int32),
            seq_lens=np.zeros(0, dtype=np.int32),
            block_table=np.zeros((0, self.max_blocks_per_req), dtype=np.int32),
            logits_indices=np.zeros(0, dtype=np.int64),
            logits_reqs=np.zeros(0, dtype=np.int64),
            max_query_len=1,
        )
        return self.upload(empty, num_reqs, self.max_blocks_per_req, num_tokens)
