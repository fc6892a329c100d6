"""SamplingMetadata: one step's sampling rules as batch tensors, built from the requests' SamplingParams."""
from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from pagedllm.sample.rng import row_key
from pagedllm.sampling_params import SamplingParams


# Up to this top_k, truncation and sampling run on a [R, max_top_k] candidate set instead of [R, V].
TOPK_CANDIDATE_LIMIT = 1024


@dataclass
class SamplingMetadata:
    """Batch of B requests over a vocabulary of V tokens. Optional tensors are None when no row needs
    them, which is also how the sampler knows to skip that stage. Per-row tensors are [B] in batch
    order even where only the randomly sampled rows use them (greedy rows then hold neutral values)."""

    num_reqs: int  # B
    vocab_size: int  # V

    # Which rows are sampled how.
    all_greedy: bool
    all_random: bool
    random_indices: torch.Tensor | None  # [R] int64, the non-greedy rows; None unless the batch is mixed
    temperature: torch.Tensor | None  # [B] float32, 1.0 on greedy rows; None when all_greedy
    top_k: torch.Tensor | None  # [B] int64 in [1, V], V where disabled; None when no random row uses it
    max_top_k: int  # largest active top_k (0 when top_k is None)
    # Every random row has a top_k <= TOPK_CANDIDATE_LIMIT: sample among the max_top_k best tokens only.
    topk_candidates: bool
    top_p: torch.Tensor | None  # [B] float32 in (0, 1], 1.0 where disabled; None when unused
    min_p: torch.Tensor | None  # [B] float32 in [0, 1], 0.0 where disabled; None when unused
    rng_key0: torch.Tensor | None  # [B] int64 in [0, 2**32), from (seed, len(output)); None when all_greedy
    rng_key1: torch.Tensor | None  # [B] int64 in [0, 2**32)

    # Logit processing, applied before both greedy and random sampling.
    disallowed_mask: torch.Tensor | None  # [B, V] bool, True where allowed_token_ids excludes a token
    bias_rows: torch.Tensor | None  # [M] int64 \
    bias_cols: torch.Tensor | None  # [M] int64  } logit_bias as a sparse [B, V] addition
    bias_values: torch.Tensor | None  # [M] float32 /
    stop_rows: torch.Tensor | None  # [S] int64 \ stop tokens masked to -inf while len(output) < min_tokens
    stop_cols: torch.Tensor | None  # [S] int64 /

    # Penalties (vLLM definitions); no_penalties means every penalty tensor below is None.
    no_penalties: bool
    repetition_penalties: torch.Tensor | None  # [B] float32, 1.0 where disabled
    frequency_penalties: torch.Tensor | None  # [B] float32, 0.0 where disabled
    presence_penalties: torch.Tensor | None  # [B] float32, 0.0 where disabled
    # Largest `logprobs` asked by any row (0 = only the sampled token); None when nobody asked.
    max_num_logprobs: int | None

    # The tokens the penalties touch, a few thousand entries instead of B x V passes:
    seen_index: torch.Tensor | None = None  # [N] int64 row * V + token for each token in an output (or, with
    # a repetition penalty in the batch, in a prompt), ascending. On the CPU each once; on a GPU once per
    # occurrence (dropping the repeats would need their number on the host, i.e. a sync).
    seen_output_counts: torch.Tensor | None = None  # [N] float32, the token's occurrences in the row's output
    repetition_seen: bool = False  # seen_index includes the prompts: the repetition penalty applies



def _int64_tensor(values: Iterable[int], device: torch.device) -> torch.Tensor:
    """1-D int64 tensor from Python ints; array('q') converts in C, several times faster than
    torch.tensor on a long list."""
    return _buffer_to_tensor(array("q", values), device)


def _concat_int64(lists: Iterable[Sequence[int]], device: torch.device) -> torch.Tensor:
    """All sequences back to back as one int64 tensor. int64 arrays are copied as memory; for lists,
    array.fromlist is the fastest bulk conversion of Python ints (prompt and output ids add up to many
    thousands per step, so the runner hands penalised requests' ids over as cached arrays)."""
    buf = array("q")
    for values in lists:
        if isinstance(values, array) and values.typecode == "q":
            buf.extend(values)
        else:
            buf.fromlist(values if isinstance(values, list) else list(values))
    return _buffer_to_tensor(buf, device)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting: a blocking copy from pageable memory would wait for
    every kernel already queued, i.e. for the step's forward pass, and undo asynchronous scheduling.
    The pinned staging copy is held by torch's caching host allocator until the transfer is done."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _buffer_to_tensor(buf: array, device: torch.device) -> torch.Tensor:
    if not buf:
        return torch.empty(0, dtype=torch.int64, device=device)
    return _to_device(torch.frombuffer(buf, dtype=torch.int64), device)


def _flat_index(
    rows_cols: list[tuple[int, list[int]]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """[(row, [col, ...]), ...] -> (rows [M] int64, cols [M] int64) on device."""
    rows = _int64_tensor([r for r, _ in rows_cols], device)
    lengths = _int64_tensor([len(c) for _, c in rows_cols], device)
    cols = _concat_int64((c for _, c in rows_cols), device)
    return rows.repeat_interleave(lengths, output_size=cols.numel()), cols


def _pack_rows(columns: dict[str, list], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """{name: [B] values} -> {name: [B] tensor}, all views of one [F, B] tensor moved in one copy."""
    if not columns:
        return {}
    packed = _to_device(torch.tensor(list(columns.values()), dtype=dtype), device)
    return dict(zip(columns, packed.unbind(0)))


def _scatter_mask(
    rows_cols: list[tuple[int, list[int]]], num_reqs: int, vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[B, V] bool with True at every listed (row, col); built on the device from small index lists."""
    mask = torch.zeros(num_reqs, vocab_size, dtype=torch.bool, device=device)
    rows, cols = _flat_index(rows_cols, device)
    mask[rows, cols] = True
    return mask


def _seen_tokens(
    prompt_token_ids: Sequence[Sequence[int]] | None, output_token_ids: Sequence[Sequence[int]], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (row, token) in the outputs (and prompts, if given) once, as row * V + token ascending [N]
    int64, with its occurrences in the row's output [N] float32 (CPU only: unique sizes its output)."""
    cpu = torch.device("cpu")
    rows, cols = _flat_index(list(enumerate(output_token_ids)), cpu)
    out_keys, out_counts = torch.unique(rows * vocab_size + cols, return_counts=True)
    keys = out_keys
    if prompt_token_ids is not None:
        rows, cols = _flat_index(list(enumerate(prompt_token_ids)), cpu)
        keys = torch.unique(torch.cat([out_keys, rows * vocab_size + cols]))
    counts = torch.zeros(keys.numel(), dtype=torch.float32)
    counts[torch.searchsorted(keys, out_keys)] = out_counts.to(torch.float32)
    return keys, counts


def _seen_tokens_on_device(
    prompt_token_ids: Sequence[Sequence[int]] | None,
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """_seen_tokens without a host sync: every output (and prompt, if given) occurrence as row * V + token
    [N] int64, ascending with repeats, with the token's occurrences in the row's output [N] float32,
    counted by two binary searches in the sorted output keys."""
    rows, cols = _flat_index(list(enumerate(output_token_ids)), device)
    out_keys = rows * vocab_size + cols
    ordered = out_keys.sort().values
    keys = ordered
    if prompt_token_ids is not None:
        rows, cols = _flat_index(list(enumerate(prompt_token_ids)), device)
        keys = torch.cat([out_keys, rows * vocab_size + cols]).sort().values
    counts = torch.searchsorted(ordered, keys, right=True) - torch.searchsorted(ordered, keys)
    return keys, counts.to(torch.float32)


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],  # lists, or int64 arrays (array("q"))
    output_token_ids: Sequence[Sequence[int]],
    seeds: list[int],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Builds the batch tensors. seeds: one int per request (the engine derives one for unseeded
    requests); the random stream of row i depends only on seeds[i] and len(output_token_ids[i])."""
    num_reqs = len(params)
    if not (len(prompt_token_ids) == len(output_token_ids) == len(seeds) == num_reqs):
        raise ValueError("params, prompt_token_ids, output_token_ids and seeds must have one entry per request")
    V = vocab_size

    def f32(values: list[float]) -> torch.Tensor:
        return _to_device(torch.tensor(values, dtype=torch.float32), device)

    def i64(values: list[int]) -> torch.Tensor:
        return _int64_tensor(values, device)

    # Per-row vectors are gathered here and sent to the device in one copy per dtype.
    row_floats: dict[str, list[float]] = {}
    row_ints: dict[str, list[int]] = {}

    # --- how each row is sampled ---
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    all_greedy = not random_rows
    all_random = len(random_rows) == num_reqs
    random_indices = None
    max_top_k = 0
    topk_candidates = False
    if not all_greedy:
        if not all_random:
            random_indices = i64(random_rows)
        row_floats["temperature"] = [1.0 if p.greedy else p.temperature for p in params]
        ks = [p.top_k if (not p.greedy and 0 < p.top_k < V) else V for p in params]
        if any(k < V for k in ks):
            row_ints["top_k"] = ks
            max_top_k = max(k for k in ks if k < V)
            topk_candidates = max_top_k <= TOPK_CANDIDATE_LIMIT and all(ks[i] < V for i in random_rows)
        ps = [1.0 if p.greedy else p.top_p for p in params]
        if any(p < 1.0 for p in ps):
            row_floats["top_p"] = ps
        mps = [0.0 if p.greedy else p.min_p for p in params]
        if any(m > 0.0 for m in mps):
            row_floats["min_p"] = mps
        keys = [row_key(s, len(out)) for s, out in zip(seeds, output_token_ids)]
        row_ints["key0"] = [k[0] for k in keys]
        row_ints["key1"] = [k[1] for k in keys]

    # --- logit processing ---
    allowed = [
        (i, [t for t in p.allowed_token_ids if 0 <= t < V])
        for i, p in enumerate(params)
        if p.allowed_token_ids is not None
    ]
    disallowed_mask = None
    if allowed:
        allowed_mask = _scatter_mask(allowed, num_reqs, V, device)
        row_has_list = torch.zeros(num_reqs, 1, dtype=torch.bool, device=device)
        row_has_list[[i for i, _ in allowed]] = True
        disallowed_mask = row_has_list & ~allowed_mask

    bias_rows = bias_cols = bias_values = None
    biased = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
    if biased:
        entries = [(i, t, b) for i, lb in biased for t, b in lb.items() if 0 <= t < V]
        if entries:
            bias_rows = i64([e[0] for e in entries])
            bias_cols = i64([e[1] for e in entries])
            bias_values = f32([e[2] for e in entries])

    stop_rows = stop_cols = None
    blocked = [
        (i, sorted(t for t in p.all_stop_token_ids if 0 <= t < V))
        for i, p in enumerate(params)
        if len(output_token_ids[i]) < p.min_tokens and p.all_stop_token_ids
    ]
    if any(cols for _, cols in blocked):
        stop_rows, stop_cols = _flat_index(blocked, device)

    # --- penalties ---
    no_penalties = not any(p.has_penalties for p in params)
    seen_index = seen_output_counts = None
    with_repetition = False
    if not no_penalties:
        row_floats["repetition"] = [p.repetition_penalty for p in params]
        row_floats["frequency"] = [p.frequency_penalty for p in params]
        row_floats["presence"] = [p.presence_penalty for p in params]
        with_repetition = any(p.repetition_penalty != 1.0 for p in params)
        prompts = prompt_token_ids if with_repetition else None
        if device.type == "cpu":
            seen_index, seen_output_counts = _seen_tokens(prompts, output_token_ids, V)
        else:
            seen_index, seen_output_counts = _seen_tokens_on_device(prompts, output_token_ids, V, device)

    floats = _pack_rows(row_floats, torch.float32, device)
    ints = _pack_rows(row_ints, torch.int64, device)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        num_reqs=num_reqs,
        vocab_size=V,
        all_greedy=all_greedy,
        all_random=all_random,
        random_indices=random_indices,
        temperature=floats.get("temperature"),
        top_k=ints.get("top_k"),
        max_top_k=max_top_k,
        topk_candidates=topk_candidates,
        top_p=floats.get("top_p"),
        min_p=floats.get("min_p"),
        rng_key0=ints.get("key0"),
        rng_key1=ints.get("key1"),
        disallowed_mask=disallowed_mask,
        bias_rows=bias_rows,
        bias_cols=bias_cols,
        bias_values=bias_values,
        stop_rows=stop_rows,
        stop_cols=stop_cols,
        no_penalties=no_penalties,
        repetition_penalties=floats.get("repetition"),
        frequency_penalties=floats.get("frequency"),
        presence_penalties=floats.get("presence"),
        seen_index=seen_index,
        seen_output_counts=seen_output_counts,
        repetition_seen=seen_index is not None and with_repetition,
        max_num_logprobs=max(asked) if asked else None,
    )
