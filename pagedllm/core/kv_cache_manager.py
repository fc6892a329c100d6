"""KVCacheManager: per-request block tables on top of the BlockPool, with automatic prefix caching."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already indexed in the prefix cache.
        self.req_to_num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks: (blocks, number of tokens they hold).

        At least one token is always left to compute, since the step must produce logits for it.
        A pure lookup: a request that then fails to get blocks is looked up again next step, so the
        scheduler records stats only on admission (``record_prefix_cache_stats``).
        """
        if not self.enable_caching or request.skips_prefix_cache:
            return [], 0
        hashes = request.block_hashes(self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in hashes[:max_hit_blocks]:
            b = self.block_pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def record_prefix_cache_stats(self, request: Request, num_hit_tokens: int) -> None:
        """Counts one admitted request's lookup: its known tokens as queries, its hit tokens as hits."""
        if not self.enable_caching or request.skips_prefix_cache:
            return
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Makes room for ``num_new_tokens`` more tokens after the computed ones.

        ``new_computed_blocks`` are prefix-cache hits taken on the request's first schedule. Returns the
        newly allocated blocks, or None (changing nothing) when the pool cannot supply them.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is not None and not new_computed_blocks:
            # Fast path for a decode step that fits in the blocks it already has.
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens <= len(blocks) * self.block_size:
                if num_tokens // self.block_size > self.req_to_num_cached_blocks[request.request_id]:
                    self._cache_full_blocks(request, num_tokens)
                return []
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(blocks) - len(new_computed_blocks)
        # Hits sitting in the free queue stop being free once touched, so they count against it.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.block_pool.get_num_free_blocks():
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        self.req_to_num_cached_blocks.setdefault(request.request_id, 0)
        self.req_to_num_cached_blocks[request.request_id] += len(new_computed_blocks)
        # Index blocks that are full once this step runs. Within one forward pass every layer writes the
        # whole batch's K/V before attending, so another request may hit them in this same step.
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        # A chunk may end before the prompt does; never hash past the tokens known so far.
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.req_to_num_cached_blocks[request.request_id]
        if num_full <= start:
            return
        hashes = request.block_hashes(self.block_size)
        blocks = self.req_to_blocks[request.request_id]
        self.block_pool.cache_blocks(blocks[start:num_full], hashes[start:num_full])
        self.req_to_num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Releases a request's blocks; tail blocks go first so shared prefixes stay cached longest."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
