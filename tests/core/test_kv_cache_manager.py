"""KVCacheManager: prefix hits on full blocks, the hit cap, allocation that fails atomically, freeing order, hashing."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from array import array

from pagedllm.core.hashing import BlockHasher, hash_block_tokens
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 4


def make_req(rid: str, tokens: list[int], cache_salt: str | None = None, **params) -> Request:
    return Request(rid, tokens, SamplingParams(**params), seed=0, cache_salt=cache_salt)


def schedule(kv: KVCacheManager, req: Request, num_new: int | None = None):
    """What the scheduler does for a waiting request: look up hits, allocate, advance."""
    hits, n_hit = kv.get_computed_blocks(req)
    if num_new is None:
        num_new = req.num_tokens - n_hit
    new = kv.allocate_slots(req, num_new, hits)
    assert new is not None
    kv.record_prefix_cache_stats(req, n_hit)
    req.num_computed_tokens = n_hit + num_new
    return hits, n_hit, new


def ref_cnts(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.block_pool.blocks]


def cached_ids(kv: KVCacheManager) -> set[int]:
    return {b.block_id for b in kv.block_pool.cached_blocks.values()}


P = list(range(100, 110))  # 10 tokens: 2.5 blocks of 4


# ---- prefix hits ---------------------------------------------------------------------------------


def test_first_request_allocates_fresh_blocks_and_indexes_only_full_ones():
    kv = KVCacheManager(8, BS)
    a = make_req("a", P)
    hits, n_hit, new = schedule(kv, a)
    assert (hits, n_hit) == ([], 0)
    assert [b.block_id for b in new] == [0, 1, 2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert cached_ids(kv) == {0, 1}  # block 2 holds 2 of 4 tokens
    assert kv.block_pool.blocks[2].block_hash is None
    assert ref_cnts(kv) == [1, 1, 1, 0, 0, 0, 0, 0]


def test_prompt_of_two_and_a_half_blocks_hits_exactly_the_two_full_blocks():
    kv = KVCacheManager(8, BS)
    a = make_req("a", P)
    schedule(kv, a)
    kv.free(a)
    b = make_req("b", P[:8] + [7, 7])  # same two full blocks, different half block
    hits, n_hit = kv.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [0, 1]
    assert n_hit == 8
    # The identical prompt hits the same two blocks: its half block was never indexed.
    c = make_req("c", P)
    hits_c, n_hit_c = kv.get_computed_blocks(c)
    assert [x.block_id for x in hits_c] == [0, 1] and n_hit_c == 8


def test_sharing_one_and_a_half_blocks_hits_one_block_and_a_different_first_block_hits_none():
    kv = KVCacheManager(8, BS)
    schedule(kv, make_req("a", P))
    hits, n_hit = kv.get_computed_blocks(make_req("b", P[:6] + [1, 2, 3, 4, 5]))
    assert ([x.block_id for x in hits], n_hit) == ([0], 4)
    # Hashes chain over the prefix: equal second blocks behind a different first block never hit.
    hits, n_hit = kv.get_computed_blocks(make_req("c", [0, 0, 0, 0] + P[4:]))
    assert (hits, n_hit) == ([], 0)


def test_hit_cap_leaves_one_token_to_compute():
    kv = KVCacheManager(8, BS)
    a = make_req("a", P[:8])  # exactly two blocks
    schedule(kv, a)
    assert cached_ids(kv) == {0, 1}
    b = make_req("b", P[:8])
    hits, n_hit, new = schedule(kv, b)
    assert [x.block_id for x in hits] == [0]
    assert n_hit == 4
    # The last block is recomputed into a block of b's own.
    assert [x.block_id for x in new] == [2]
    assert kv.get_block_ids("b") == [0, 2]
    assert ref_cnts(kv)[:3] == [2, 1, 1]
    # Both copies hold the same tokens; the index keeps the first one.
    assert kv.block_pool.get_cached_block(b.block_hashes(BS)[1]).block_id == 1
    assert kv.block_pool.blocks[2].block_hash is None

    # A one-block prompt can never hit.
    one = make_req("one", P[:4])
    assert kv.get_computed_blocks(one) == ([], 0)


def test_requests_with_prompt_logprobs_never_hit():
    kv = KVCacheManager(8, BS)
    schedule(kv, make_req("a", P))
    b = make_req("b", P, prompt_logprobs=0)
    assert kv.get_computed_blocks(b) == ([], 0)
    _, _, new = schedule(kv, b)
    assert [x.block_id for x in new] == [3, 4, 5]
    # Its own full blocks duplicate indexed ones: the index keeps a's.
    assert cached_ids(kv) == {0, 1}
    c = make_req("c", P, prompt_logprobs=None)
    assert [x.block_id for x in kv.get_computed_blocks(c)[0]] == [0, 1]


def test_cache_salt_separates_equal_prefixes():
    kv = KVCacheManager(16, BS)
    schedule(kv, make_req("salted", P, cache_salt="tenant-1"))
    assert kv.get_computed_blocks(make_req("plain", P)) == ([], 0)
    assert kv.get_computed_blocks(make_req("other", P, cache_salt="tenant-2")) == ([], 0)
    same_hits, n = kv.get_computed_blocks(make_req("same", P, cache_salt="tenant-1"))
    assert [x.block_id for x in same_hits] == [0, 1] and n == 8

    schedule(kv, make_req("plain2", P))
    assert kv.get_block_ids("plain2") == [3, 4, 5]
    hits, _ = kv.get_computed_blocks(make_req("plain3", P))
    assert [x.block_id for x in hits] == [3, 4]


def test_extra_keys_change_every_block_hash_of_the_chain():
    plain = BlockHasher().update(P[:8], BS)
    keyed = BlockHasher(extra_keys=("lora-1",)).update(P[:8], BS)
    other = BlockHasher(extra_keys=("lora-2",)).update(P[:8], BS)
    assert len(plain) == len(keyed) == len(other) == 2
    for i in range(2):
        assert len({plain[i], keyed[i], other[i]}) == 3


# ---- allocation ----------------------------------------------------------------------------------


def test_allocate_returns_none_and_changes_nothing_when_the_pool_is_short():
    kv = KVCacheManager(5, BS)
    a = make_req("a", list(range(12)))
    schedule(kv, a)  # blocks 0, 1, 2, all full and indexed
    kv.free(a)  # tail first: queue 3, 4, 2, 1, 0
    pool = kv.block_pool
    assert pool.free_queue.block_ids() == [3, 4, 2, 1, 0]
    before_queue = pool.free_queue.block_ids()
    before_index = dict(pool.cached_blocks)

    # b shares a's first two blocks, then 16 tokens more: 6 blocks, 2 of them hits sitting in the
    # free queue. 4 new blocks <= 5 free, but the hits stop being free once taken: 6 > 5.
    b = make_req("b", list(range(8)) + list(range(50, 66)))
    hits, n_hit = kv.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [0, 1] and n_hit == 8
    assert kv.allocate_slots(b, b.num_tokens - n_hit, hits) is None
    assert pool.free_queue.block_ids() == before_queue
    assert pool.cached_blocks == before_index
    assert ref_cnts(kv) == [0] * 5
    assert "b" not in kv.req_to_blocks and kv.get_block_ids("b") == []

    # One block shorter fits exactly, evicting from the head of the queue.
    c = make_req("c", list(range(8)) + list(range(50, 62)))
    hits, n_hit, new = schedule(kv, c)
    assert [x.block_id for x in hits] == [0, 1]
    assert [x.block_id for x in new] == [3, 4, 2]
    assert kv.get_block_ids("c") == [0, 1, 3, 4, 2]
    assert pool.get_num_free_blocks() == 0


def test_allocate_for_a_running_request_that_does_not_fit_keeps_its_blocks():
    kv = KVCacheManager(3, BS)
    a = make_req("a", list(range(7)))
    schedule(kv, a)
    b = make_req("b", list(range(20, 23)))
    schedule(kv, b)
    assert kv.get_block_ids("a") == [0, 1] and kv.get_block_ids("b") == [2]
    a.append_output_token_ids([99])
    a.num_computed_tokens = 7
    assert kv.allocate_slots(a, 1) == []  # 8th slot fits in block 1
    a.num_computed_tokens = 8
    a.append_output_token_ids([98])
    assert kv.allocate_slots(a, 1) is None
    assert kv.get_block_ids("a") == [0, 1]
    assert ref_cnts(kv) == [1, 1, 1]
    kv.free(b)
    assert [x.block_id for x in kv.allocate_slots(a, 1)] == [2]
    assert kv.get_block_ids("a") == [0, 1, 2]


def test_free_goes_tail_first_so_tail_blocks_are_evicted_before_the_shared_head():
    kv = KVCacheManager(4, BS)
    a = make_req("a", list(range(12)))
    schedule(kv, a)
    kv.free(a)
    assert kv.block_pool.free_queue.block_ids() == [3, 2, 1, 0]
    assert kv.req_to_blocks == {} and kv.req_to_num_cached_blocks == {}
    # An unrelated request takes two blocks: the never-used one, then a's tail block.
    other = make_req("x", list(range(500, 506)))
    _, _, new = schedule(kv, other)
    assert [x.block_id for x in new] == [3, 2]
    assert cached_ids(kv) == {0, 1, 3}  # 2 was evicted; x's first block 3 got indexed
    b = make_req("b", list(range(12)) + [1])
    hits, n_hit = kv.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [0, 1] and n_hit == 8


def test_shared_blocks_stay_held_until_the_last_owner_frees():
    kv = KVCacheManager(8, BS)
    a = make_req("a", P)
    b = make_req("b", P[:8] + [5, 5, 5])
    schedule(kv, a)
    schedule(kv, b)
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert ref_cnts(kv)[:4] == [2, 2, 1, 1]
    kv.free(a)
    assert ref_cnts(kv)[:4] == [1, 1, 0, 1]
    assert kv.block_pool.free_queue.block_ids() == [4, 5, 6, 7, 2]
    kv.free(b)
    assert ref_cnts(kv) == [0] * 8
    assert kv.block_pool.free_queue.block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    kv.free(b)  # freeing an unknown request is a no-op
    assert kv.block_pool.get_num_free_blocks() == 8


def test_same_step_hit_on_blocks_just_allocated():
    """b is scheduled right after a in the same step: a's blocks are indexed at allocation, so b hits."""
    kv = KVCacheManager(8, BS)
    a = make_req("a", P)
    schedule(kv, a)
    b = make_req("b", P)  # e.g. an n=2 sibling
    hits, n_hit, new = schedule(kv, b)
    assert [x.block_id for x in hits] == [0, 1]
    assert [x.block_id for x in new] == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert ref_cnts(kv)[:4] == [2, 2, 1, 1]


def test_chunked_prefill_indexes_blocks_as_chunks_fill_them():
    kv = KVCacheManager(8, BS)
    a = make_req("a", P)
    schedule(kv, a, num_new=6)
    assert kv.get_block_ids("a") == [0, 1]
    assert cached_ids(kv) == {0}  # 6 tokens: one full block
    assert [x.block_id for x in kv.get_computed_blocks(make_req("b", P))[0]] == [0]
    new = kv.allocate_slots(a, 4)
    a.num_computed_tokens += 4
    assert [x.block_id for x in new] == [2]
    assert cached_ids(kv) == {0, 1}
    assert [x.block_id for x in kv.get_computed_blocks(make_req("c", P))[0]] == [0, 1]


def test_decode_indexes_a_block_once_its_last_token_is_known():
    kv = KVCacheManager(8, BS)
    a = make_req("a", P[:7])
    schedule(kv, a)
    assert kv.get_block_ids("a") == [0, 1] and cached_ids(kv) == {0}
    a.append_output_token_ids([42])  # 8 known tokens: block 1 is now full
    assert kv.allocate_slots(a, 1) == []
    a.num_computed_tokens += 1
    assert cached_ids(kv) == {0, 1}
    assert kv.block_pool.blocks[1].block_hash == a.block_hashes(BS)[1]
    a.append_output_token_ids([43])
    new = kv.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    assert [x.block_id for x in new] == [2]
    assert cached_ids(kv) == {0, 1}
    # A later request with the prompt and the generated tokens hits both blocks.
    hits, n = kv.get_computed_blocks(make_req("b", P[:7] + [42, 43]))
    assert [x.block_id for x in hits] == [0, 1] and n == 8


def test_caching_disabled_never_hits():
    kv = KVCacheManager(8, BS, enable_caching=False)
    schedule(kv, make_req("a", P))
    assert kv.block_pool.cached_blocks == {}
    _, n_hit, new = schedule(kv, make_req("b", P))
    assert n_hit == 0 and [x.block_id for x in new] == [3, 4, 5]


def test_prefix_cache_stats_count_admitted_lookups_only():
    kv = KVCacheManager(8, BS)
    schedule(kv, make_req("a", P))
    schedule(kv, make_req("b", P))
    assert (kv.stats.queries, kv.stats.hits) == (20, 8)
    # A lookup alone (e.g. a request that then does not fit) counts nothing.
    assert len(kv.get_computed_blocks(make_req("c", P))[0]) == 2
    assert (kv.stats.queries, kv.stats.hits) == (20, 8)
    # Requests that bypass the cache are not queries.
    schedule(kv, make_req("d", P, prompt_logprobs=1))
    assert (kv.stats.queries, kv.stats.hits) == (20, 8)


def test_reset_prefix_cache_refuses_while_blocks_are_held():
    kv = KVCacheManager(8, BS)
    a = make_req("a", P)
    schedule(kv, a)
    assert kv.reset_prefix_cache() is False
    assert cached_ids(kv) == {0, 1}
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_req("b", P)) == ([], 0)
    assert kv.usage() == 0.0


# ---- hashing -------------------------------------------------------------------------------------


def test_block_hashes_are_a_sha256_chain():
    root = hashlib.sha256(b"pagedllm-prefix-cache-v1").digest()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    got = make_req("a", tokens).block_hashes(BS)
    assert len(got) == 2  # only full blocks
    h0 = hashlib.sha256(root + array("q", [1, 2, 3, 4]).tobytes()).digest()
    h1 = hashlib.sha256(h0 + array("q", [5, 6, 7, 8]).tobytes()).digest()
    assert got == [h0, h1]
    assert all(isinstance(x, bytes) and len(x) == 32 for x in got)
    assert hash_block_tokens(None, [1, 2, 3, 4]) == h0
    assert hash_block_tokens(h0, [5, 6, 7, 8]) == h1
    # Large token ids are not truncated or confused with small ones.
    assert hash_block_tokens(None, [2**40, 0, 0, 0]) != hash_block_tokens(None, [0, 0, 0, 0])


def test_block_hashes_extend_incrementally_as_tokens_arrive():
    r = make_req("a", [1, 2, 3, 4, 5, 6])
    first = list(r.block_hashes(BS))
    assert len(first) == 1
    r.append_output_token_ids([7, 8])
    assert r.block_hashes(BS)[:1] == first
    assert r.block_hashes(BS) == make_req("b", [1, 2, 3, 4, 5, 6, 7, 8]).block_hashes(BS)


_HASH_SNIPPET = (
    "from pagedllm.core.hashing import BlockHasher;"
    "print(','.join(x.hex() for x in BlockHasher(extra_keys=('salt',)).update(list(range(8)), 4)))"
)


def test_block_hashes_are_stable_across_processes_and_hash_seeds():
    local = ",".join(x.hex() for x in BlockHasher(extra_keys=("salt",)).update(list(range(8)), 4))
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", _HASH_SNIPPET], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        assert out == local
