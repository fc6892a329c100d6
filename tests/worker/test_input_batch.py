"""InputBatch and StepBuffers on CPU: exact token ids, positions, slot mappings and block tables of mixed
batches across steps (chunked prefill, prefix hits, decode, new blocks, finish, preemption), and the
padded decode layout the CUDA graphs read."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.cuda_graphs import CudaGraphRunner, capture_sizes, token_capture_sizes, warm_up_sizes
from pagedllm.worker.gpu_buffers import StepBuffers, step_layout
from pagedllm.worker.input_batch import InputBatch, is_plain_greedy

BS = 4  # block size


def _new(rid, prompt, blocks, computed=0, params=None):
    return NewRequestData(
        req_id=rid,
        prompt_token_ids=prompt,
        output_token_ids=[],
        sampling_params=params or SamplingParams(temperature=0.0),
        seed=0,
        block_ids=blocks,
        num_computed_tokens=computed,
    )


def _step(new=(), cached=(), scheduled=None, finished=(), preempted=()):
    cr = CachedRequestData(
        req_ids=[c[0] for c in cached],
        new_block_ids=[c[1] for c in cached],
        num_computed_tokens=[c[2] for c in cached],
    )
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cr,
        num_scheduled_tokens=dict(scheduled),
        total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


def _eq(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mixed_batches_across_steps():
    ib = InputBatch(BS, max_num_reqs=2, max_blocks_per_req=2)  # small, so the table has to grow
    # Step 1: a prompt chunk of 6 (of 10) and a whole 3-token prompt.
    a_prompt = list(range(100, 110))
    so = _step(
        new=[_new("a", a_prompt, [7, 3, 9]), _new("b", [200, 201, 202], [5])],
        scheduled={"a": 6, "b": 3},
    )
    ib.update_states(so)
    b = ib.prepare(so)
    assert b.req_ids == ["a", "b"]
    _eq(b.input_ids, [100, 101, 102, 103, 104, 105, 200, 201, 202])
    _eq(b.positions, [0, 1, 2, 3, 4, 5, 0, 1, 2])
    _eq(b.slot_mapping, [28, 29, 30, 31, 12, 13, 20, 21, 22])
    _eq(b.query_start_loc, [0, 6, 9])
    _eq(b.seq_lens, [6, 3])
    _eq(b.block_table, [[7, 3, 9], [5, 0, 0]])
    assert b.sampling_mask == [False, True]
    _eq(b.logits_indices, [8])
    assert (b.max_query_len, b.max_seq_len, b.is_pure_decode) == (6, 6, False)
    ib.requests["b"].output_token_ids.append(300)  # what the runner does after sampling

    # Step 2: the rest of a's prompt, b's first decode, and c with a 4-token prefix hit.
    so = _step(
        new=[_new("c", [1, 2, 3, 4, 5], [8, 2], computed=4)],
        cached=[("a", [], 6), ("b", [], 3)],
        scheduled={"a": 4, "b": 1, "c": 1},
    )
    ib.update_states(so)
    b = ib.prepare(so)
    _eq(b.input_ids, [106, 107, 108, 109, 300, 5])
    _eq(b.positions, [6, 7, 8, 9, 3, 4])
    _eq(b.slot_mapping, [14, 15, 36, 37, 23, 8])
    _eq(b.query_start_loc, [0, 4, 5, 6])
    _eq(b.seq_lens, [10, 4, 5])
    _eq(b.block_table, [[7, 3, 9], [5, 0, 0], [8, 2, 0]])
    assert b.sampling_mask == [True, True, True]
    _eq(b.logits_indices, [3, 4, 5])
    for rid, tok in (("a", 110), ("b", 301), ("c", 400)):
        ib.requests[rid].output_token_ids.append(tok)

    # Step 3: a finished; pure decode of b (into a new block) and c.
    so = _step(cached=[("b", [11], 4), ("c", [], 5)], scheduled={"b": 1, "c": 1}, finished=["a"])
    ib.update_states(so)
    b = ib.prepare(so)
    assert "a" not in ib.requests
    _eq(b.input_ids, [301, 400])
    _eq(b.positions, [4, 5])
    _eq(b.slot_mapping, [44, 9])
    _eq(b.block_table, [[5, 11], [8, 2]])
    _eq(b.seq_lens, [5, 6])
    assert b.is_pure_decode and b.max_seq_len == 6
    ib.requests["b"].output_token_ids.append(302)

    # Step 4: c preempted; d takes a's old row, which must not show a's blocks.
    so = _step(
        new=[_new("d", [50, 51], [4])],
        cached=[("b", [], 5)],
        scheduled={"b": 1, "d": 2},
        preempted=["c"],
    )
    ib.update_states(so)
    b = ib.prepare(so)
    assert set(ib.requests) == {"b", "d"}
    _eq(b.input_ids, [302, 50, 51])
    _eq(b.positions, [5, 0, 1])
    _eq(b.slot_mapping, [45, 16, 17])
    _eq(b.block_table, [[5, 11], [4, 0]])
    _eq(b.logits_indices, [0, 2])


def test_rows_are_reused_and_grow():
    ib = InputBatch(BS, max_num_reqs=1, max_blocks_per_req=1)
    names = [f"r{i}" for i in range(5)]
    so = _step(new=[_new(n, [1, 2, 3], [10 * i + 1]) for i, n in enumerate(names)], scheduled={n: 3 for n in names})
    ib.update_states(so)
    assert sorted(st.row for st in ib.requests.values()) == [0, 1, 2, 3, 4]
    so = _step(finished=["r1", "r3"], cached=[("r0", [99], 3)], scheduled={"r0": 1})
    ib.update_states(so)
    freed = {1, 3}
    so = _step(new=[_new("x", [7], [5])], scheduled={"x": 1})
    ib.update_states(so)
    assert ib.requests["x"].row in freed
    _eq(ib.block_table.table[ib.requests["r0"].row, :2], [1, 99])


def test_plain_greedy_flags():
    assert is_plain_greedy(SamplingParams(temperature=0.0))
    assert not is_plain_greedy(SamplingParams(temperature=0.7))
    assert not is_plain_greedy(SamplingParams(temperature=0.0, logprobs=2))
    assert not is_plain_greedy(SamplingParams(temperature=0.0, repetition_penalty=1.2))
    assert not is_plain_greedy(SamplingParams(temperature=0.0, logit_bias={3: 1.0}))
    assert not is_plain_greedy(SamplingParams(temperature=0.0, allowed_token_ids=[1, 2]))
    assert not is_plain_greedy(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7]))
    assert is_plain_greedy(SamplingParams(temperature=0.0, min_tokens=2))


def _decode_batch(ib):
    names = ["p", "q", "r"]
    so = _step(
        new=[_new(n, [1] * (3 + i), [3 * i + 1, 3 * i + 2]) for i, n in enumerate(names)],
        scheduled={n: 3 + i for i, n in enumerate(names)},
    )
    ib.update_states(so)
    ib.prepare(so)
    for i, n in enumerate(names):
        ib.requests[n].output_token_ids.append(500 + i)
    so = _step(cached=[(n, [], 3 + i) for i, n in enumerate(names)], scheduled={n: 1 for n in names})
    ib.update_states(so)
    return ib.prepare(so)


def test_step_buffers_pad_a_decode_batch_onto_the_graph_views():
    ib = InputBatch(BS)
    b = _decode_batch(ib)
    bufs = StepBuffers(torch.device("cpu"), max_tokens=16, max_reqs=8, max_blocks_per_req=5)
    dev = bufs.upload(b, num_reqs_padded=4, block_width=5)
    _eq(dev.input_ids, [500, 501, 502, 0])
    _eq(dev.positions, [3, 4, 5, 0])
    _eq(dev.slot_mapping, [7, 20, 33, -1])
    _eq(dev.query_start_loc, [0, 1, 2, 3, 4])
    _eq(dev.seq_lens, [4, 5, 6, 0])
    _eq(dev.block_table, [[1, 2, 0, 0, 0], [4, 5, 0, 0, 0], [7, 8, 0, 0, 0], [0, 0, 0, 0, 0]])
    _eq(dev.logits_indices, [0, 1, 2])
    _eq(dev.decode_order, [2, 1, 0, 3])  # longest context first, padding last
    # The graph of size 4 reads exactly these addresses.
    views = bufs.decode_views(4)
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table",
                 "decode_order"):
        assert getattr(views, name).data_ptr() == getattr(dev, name).data_ptr(), name
        assert getattr(views, name).shape == getattr(dev, name).shape, name
    # Unpadded, compact: the table keeps the batch's own width.
    dev = bufs.upload(b)
    assert dev.block_table.shape == (3, 2)
    _eq(dev.slot_mapping, [7, 20, 33])


def test_step_buffers_pad_a_mixed_batch_onto_the_token_graph_views():
    # A prompt chunk of 3 plus a 4-token prompt, padded to 12 tokens and 5 requests: request 2 owns the
    # five padding tokens with sequence length 0, requests 3 and 4 own none.
    ib = InputBatch(BS)
    so = _step(new=[_new("a", [10, 11, 12, 13, 14], [6, 2]), _new("b", [20, 21, 22, 23], [8])],
               scheduled={"a": 3, "b": 4})
    ib.update_states(so)
    b = ib.prepare(so)
    bufs = StepBuffers(torch.device("cpu"), max_tokens=16, max_reqs=5, max_blocks_per_req=3)
    dev = bufs.upload(b, 5, 3, num_tokens_padded=12)
    _eq(dev.input_ids, [10, 11, 12, 20, 21, 22, 23, 0, 0, 0, 0, 0])
    _eq(dev.positions, [0, 1, 2, 0, 1, 2, 3, 0, 0, 0, 0, 0])
    _eq(dev.slot_mapping, [24, 25, 26, 32, 33, 34, 35, -1, -1, -1, -1, -1])
    _eq(dev.query_start_loc, [0, 3, 7, 12, 12, 12])
    _eq(dev.seq_lens, [3, 4, 0, 0, 0])
    _eq(dev.block_table, [[6, 2, 0], [8, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    _eq(dev.logits_indices, [6])  # a's chunk ends mid-prompt: only b samples
    views = bufs.static_views(12, 5)
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table"):
        assert getattr(views, name).data_ptr() == getattr(dev, name).data_ptr(), name
        assert getattr(views, name).shape == getattr(dev, name).shape, name
    # Padding tokens need a padding request to own them.
    with pytest.raises(ValueError, match="padding tokens need a padding request"):
        bufs.upload(b, 2, 3, num_tokens_padded=12)


def test_token_capture_sizes():
    sizes = token_capture_sizes(8192)
    assert sizes[:9] == [16, 32, 64, 128, 256, 320, 384, 448, 512]
    assert sizes[-5:] == [4096, 5120, 6144, 7168, 8192] and len(sizes) == 25
    # Never more than 25% padding above 16 tokens, and the budget itself always has a graph.
    assert all(b / a <= 2.0 for a, b in zip(sizes, sizes[1:]) if a < 256)
    assert all(b / a <= 1.25 for a, b in zip(sizes, sizes[1:]) if a >= 256)
    assert token_capture_sizes(1000)[-2:] == [896, 1000]
    assert token_capture_sizes(100) == [16, 32, 64, 100]
    assert token_capture_sizes(8) == [8]
    # Past 8192 tokens steps run eagerly: no graph above the cap.
    assert token_capture_sizes(32768)[-1] == 8192 and token_capture_sizes(32768) == sizes


def test_layout_is_aligned_and_graph_sections_ignore_sampled_rows_and_pending_tokens():
    a, _ = step_layout(8, 8, 128, 0)
    b, _ = step_layout(8, 8, 128, 8, 5)
    tail = ("logits_indices", "logits_reqs", "pending_dst", "pending_src")
    for name, (offset, _count) in a.items():
        assert offset % 64 == 0
        if name not in tail:
            assert b[name] == a[name]
    assert [b[name][1] for name in tail] == [8, 8, 5, 5]


def test_capture_sizes_and_buckets():
    assert capture_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert capture_sizes(1000) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    runner = CudaGraphRunner(capture_sizes(12), capture=False)
    assert [runner.bucket_for(n) for n in (1, 3, 5, 9, 12, 13)] == [1, 4, 8, 12, 12, None]


def test_only_the_largest_size_of_each_specialisation_class_is_warmed_up_eagerly():
    assert warm_up_sizes(capture_sizes(256)) == {256, 8, 1}
    assert warm_up_sizes(token_capture_sizes(8192)) == {8192}
    # A cap off the multiples of 16 is its own class; the multiples below it still need one warm-up.
    assert warm_up_sizes(capture_sizes(100)) == {100, 64, 1}
    assert warm_up_sizes(token_capture_sizes(2050)) == {2050, 2048}


def test_token_arrays_follow_the_lists_and_feed_the_same_penalty_metadata():
    from array import array

    from pagedllm.sample.metadata import build_sampling_metadata
    from pagedllm.worker.input_batch import CachedRequestState

    params = SamplingParams(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1)
    st = CachedRequestState("r", [5, 9, 9, 2], [], params, 1, [], 0)
    prompt, out = st.token_arrays()
    assert list(prompt) == [5, 9, 9, 2] and list(out) == [] and prompt.typecode == out.typecode == "q"
    for tok in (7, 9, 7):
        st.output_token_ids.append(tok)
        prompt2, out = st.token_arrays()
        assert prompt2 is prompt and list(out) == st.output_token_ids
    other = CachedRequestState("s", [1], [3, 3], SamplingParams(temperature=0.5), 2, [], 0)
    as_arrays = [s.token_arrays() for s in (st, other)]
    as_lists = [(s.prompt_token_ids, s.output_token_ids) for s in (st, other)]
    mds = [
        build_sampling_metadata([st.sampling_params, other.sampling_params], [p for p, _ in ids],
                                [o for _, o in ids], [1, 2], 12, torch.device("cpu"))
        for ids in (as_arrays, as_lists)
    ]
    assert isinstance(as_arrays[0][0], array)
    assert torch.equal(mds[0].seen_index, mds[1].seen_index)
    assert torch.equal(mds[0].seen_output_counts, mds[1].seen_output_counts)
    seen = dict(zip(mds[0].seen_index.tolist(), mds[0].seen_output_counts.tolist()))
    assert seen[0 * 12 + 7] == 2 and seen[1 * 12 + 3] == 2 and seen[0 * 12 + 9] == 1 and seen[0 * 12 + 5] == 0
    assert torch.equal(mds[0].rng_key0, mds[1].rng_key0)
