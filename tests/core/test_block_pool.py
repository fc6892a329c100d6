"""BlockPool and FreeBlockQueue: exact block ids, LRU eviction order, reference counts and the prefix-hash index."""
from __future__ import annotations

import hashlib

import pytest

from pagedllm.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def h(i: int) -> bytes:
    """A stand-in block hash (the pool treats hashes as opaque bytes)."""
    return hashlib.sha256(f"block-{i}".encode()).digest()


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def check_consistent(pool: BlockPool) -> None:
    """Queue membership, ref counts and the index agree with each other."""
    queued = pool.free_queue.block_ids()
    assert len(queued) == len(set(queued)) == pool.get_num_free_blocks()
    for b in pool.blocks:
        assert b.ref_cnt >= 0
        assert (b.block_id in queued) == (b.ref_cnt == 0), b
    for hh, b in pool.cached_blocks.items():
        assert b.block_hash == hh


# ---- FreeBlockQueue ------------------------------------------------------------------------------


def test_queue_keeps_insertion_order_and_pops_from_head():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.num_free_blocks == 5
    assert q.block_ids() == [0, 1, 2, 3, 4]
    assert q.popleft() is blocks[0]
    assert q.popleft() is blocks[1]
    assert q.block_ids() == [2, 3, 4]
    q.append(blocks[0])
    assert q.block_ids() == [2, 3, 4, 0]
    assert q.num_free_blocks == 4


def test_queue_remove_from_middle_head_and_tail():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4]
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert q.block_ids() == [1, 3]
    assert q.num_free_blocks == 2
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    # A removed block is no longer linked: removing it again is an error, not silent corruption.
    with pytest.raises(AssertionError):
        q.remove(blocks[2])
    q.append(blocks[2])
    assert q.block_ids() == [1, 3, 2]


def test_queue_popleft_on_empty_raises():
    b = KVCacheBlock(0)
    q = FreeBlockQueue([b])
    assert q.popleft() is b
    assert q.num_free_blocks == 0
    assert q.block_ids() == []
    with pytest.raises(RuntimeError):
        q.popleft()
    q.append(b)
    assert q.popleft() is b


# ---- BlockPool -----------------------------------------------------------------------------------


def test_fresh_pool_hands_out_ids_in_order():
    pool = BlockPool(6)
    assert pool.get_num_free_blocks() == 6
    assert pool.get_usage() == 0.0
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(3)
    assert ids(a) == [0, 1]
    assert ids(b) == [2, 3, 4]
    assert all(x.ref_cnt == 1 for x in a + b)
    assert pool.get_num_free_blocks() == 1
    assert pool.free_queue.block_ids() == [5]
    assert pool.get_usage() == pytest.approx(5 / 6)
    assert pool.get_new_blocks(0) == []
    check_consistent(pool)


def test_asking_for_too_many_blocks_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)
    assert pool.get_num_free_blocks() == 1
    assert pool.free_queue.block_ids() == [2]
    assert ids(pool.get_new_blocks(1)) == [2]


def test_free_appends_to_tail_in_given_order_and_evicts_least_recently_freed():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(4)  # 0..3; 4, 5 still free
    pool.free_blocks([blocks[2], blocks[0]])
    pool.free_blocks([blocks[3]])
    assert pool.free_queue.block_ids() == [4, 5, 2, 0, 3]
    assert [b.ref_cnt for b in pool.blocks] == [0, 1, 0, 0, 0, 0]
    # Never-used blocks first, then in the order they were freed.
    assert ids(pool.get_new_blocks(3)) == [4, 5, 2]
    assert ids(pool.get_new_blocks(2)) == [0, 3]
    assert pool.get_num_free_blocks() == 0
    check_consistent(pool)


def test_eviction_drops_the_hash_from_the_index():
    pool = BlockPool(3)
    a = pool.get_new_blocks(3)
    pool.cache_blocks(a[:2], [h(0), h(1)])
    assert pool.get_cached_block(h(0)) is a[0]
    assert pool.get_cached_block(h(1)) is a[1]
    pool.free_blocks(a)  # queue 0, 1, 2
    # Free but still cached: reusable until evicted.
    assert pool.get_cached_block(h(0)) is a[0]
    (b,) = pool.get_new_blocks(1)
    assert b is a[0]
    assert b.block_hash is None
    assert pool.get_cached_block(h(0)) is None
    assert pool.get_cached_block(h(1)) is a[1]
    assert set(pool.cached_blocks) == {h(1)}
    (c,) = pool.get_new_blocks(1)
    assert c is a[1] and c.block_hash is None
    assert pool.cached_blocks == {}
    check_consistent(pool)


def test_touch_takes_a_cached_free_block_out_of_the_middle_of_the_queue():
    pool = BlockPool(5)
    a = pool.get_new_blocks(5)
    pool.cache_blocks(a, [h(i) for i in range(5)])
    pool.free_blocks(a)
    assert pool.free_queue.block_ids() == [0, 1, 2, 3, 4]
    hit = pool.get_cached_block(h(2))
    assert hit is a[2]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.free_queue.block_ids() == [0, 1, 3, 4]
    assert pool.get_num_free_blocks() == 4
    # The touched block keeps its hash and is skipped by eviction.
    assert ids(pool.get_new_blocks(4)) == [0, 1, 3, 4]
    assert pool.get_cached_block(h(2)) is hit
    assert hit.block_hash == h(2)
    check_consistent(pool)


def test_touch_on_a_block_in_use_only_adds_a_reference():
    pool = BlockPool(3)
    a = pool.get_new_blocks(2)
    pool.cache_blocks(a, [h(0), h(1)])
    pool.touch(a)
    assert [b.ref_cnt for b in a] == [2, 2]
    assert pool.free_queue.block_ids() == [2]
    check_consistent(pool)


def test_two_requests_share_blocks_with_reference_counts():
    pool = BlockPool(6)
    req1 = pool.get_new_blocks(3)  # 0, 1, 2
    pool.cache_blocks(req1[:2], [h(0), h(1)])
    # A second request hits the two cached blocks and adds one of its own.
    hits = [pool.get_cached_block(h(0)), pool.get_cached_block(h(1))]
    pool.touch(hits)
    req2 = hits + pool.get_new_blocks(1)
    assert ids(req2) == [0, 1, 3]
    assert [b.ref_cnt for b in pool.blocks] == [2, 2, 1, 1, 0, 0]
    assert pool.get_num_free_blocks() == 2

    pool.free_blocks(reversed(req1))
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 0, 1, 0, 0]
    assert pool.free_queue.block_ids() == [4, 5, 2]  # only the unshared block came free

    pool.free_blocks(reversed(req2))
    assert [b.ref_cnt for b in pool.blocks] == [0] * 6
    assert pool.free_queue.block_ids() == [4, 5, 2, 3, 1, 0]
    assert pool.get_num_free_blocks() == 6
    check_consistent(pool)


def test_freeing_a_free_block_is_an_error():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(AssertionError):
        pool.free_blocks([a])


def test_duplicate_hash_keeps_the_first_block_and_evicting_the_copy_keeps_the_index():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_blocks([a], [h(7)])
    pool.cache_blocks([b], [h(7)])
    assert a.block_hash == h(7)
    assert b.block_hash is None
    assert pool.get_cached_block(h(7)) is a
    # Re-caching an indexed block is a no-op (it keeps its hash).
    pool.cache_blocks([a], [h(8)])
    assert a.block_hash == h(7) and pool.get_cached_block(h(8)) is None
    pool.free_blocks([b, a])
    assert ids(pool.get_new_blocks(3)) == [2, 3, 1]  # the uncached copy goes first
    assert pool.get_cached_block(h(7)) is a


def test_caching_disabled_indexes_nothing():
    pool = BlockPool(3, enable_caching=False)
    a = pool.get_new_blocks(2)
    pool.cache_blocks(a, [h(0), h(1)])
    assert pool.cached_blocks == {}
    assert all(b.block_hash is None for b in a)


def test_reset_prefix_cache_only_when_every_block_is_free():
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    pool.cache_blocks(a, [h(0), h(1), h(2)])
    pool.free_blocks(a[1:])
    assert pool.reset_prefix_cache() is False
    # Nothing was forgotten.
    assert set(pool.cached_blocks) == {h(0), h(1), h(2)}
    assert [b.block_hash for b in a] == [h(0), h(1), h(2)]

    pool.free_blocks(a[:1])
    assert pool.get_num_free_blocks() == 4
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {}
    assert all(b.block_hash is None for b in pool.blocks)
    # The free queue is untouched by a reset.
    assert pool.free_queue.block_ids() == [3, 1, 2, 0]
    check_consistent(pool)
