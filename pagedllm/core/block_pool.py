"""BlockPool: the KV-cache blocks, their reference counts, the LRU free queue and the prefix-hash index."""
from __future__ import annotations

from typing import Iterable


class KVCacheBlock:
    """Metadata of one physical block. The KV data itself lives in the model runner's tensors."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set once the block is full and indexed for reuse
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; the head is evicted first.

    A freed block goes to the tail, so the head is the least recently used. Linked rather than a
    deque because a prefix-cache hit takes a block out of the middle, which must be O(1).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels keep insert/remove free of edge cases
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise RuntimeError("no free KV-cache block left")
        self.remove(first)
        return first

    def block_ids(self) -> list[int]:
        """Free block ids in eviction order (for tests and debugging)."""
        out, b = [], self._head.next_free
        while b is not None and b is not self._tail:
            out.append(b.block_id)
            b = b.next_free
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on prefix-cache hits, pulling free ones out of the eviction queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.get_num_free_blocks()} free")
        out = []
        for _ in range(num_blocks):
            b = self.free_queue.popleft()
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def cache_blocks(self, blocks: list[KVCacheBlock], hashes: list[bytes]) -> None:
        """Indexes full blocks by their hash so later requests with the same prefix reuse them."""
        if not self.enable_caching:
            return
        for b, h in zip(blocks, hashes):
            if b.block_hash is not None:
                continue
            # When two requests computed the same block, keep the first: both stay valid copies,
            # and the duplicate returns to the pool uncached when its owner frees it.
            if h not in self.cached_blocks:
                b.block_hash = h
                self.cached_blocks[h] = b

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference each; blocks reaching zero join the tail of the free queue in order."""
        for b in blocks:
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"{b} freed twice"
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; only allowed when no request holds a block."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
        self.cached_blocks.clear()
        return True
