"""Prefix-cache block hashes: a sha256 chain over full blocks of token ids plus optional extra keys."""
from __future__ import annotations

import hashlib
import json
from array import array
from typing import Sequence

# The chain's root: a fixed value, so equal token prefixes hash equally across runs and processes.
_ROOT = hashlib.sha256(b"pagedllm-prefix-cache-v1").digest()


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> bytes:
    """sha256(parent || token ids as int64 || extra keys): a block's hash commits to its whole prefix."""
    h = hashlib.sha256(parent_hash or _ROOT)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        # Adapter ids, cache salts, multimodal hashes: anything that changes the KV of the same tokens.
        h.update(json.dumps(extra_keys, sort_keys=True, default=str).encode())
    return h.digest()


class BlockHasher:
    """Remembers the hashes of a token list's full blocks and extends them as tokens arrive."""

    def __init__(self, extra_keys: tuple | None = None) -> None:
        self.extra_keys = extra_keys
        self.hashes: list[bytes] = []

    def update(self, token_ids: Sequence[int], block_size: int) -> list[bytes]:
        num_full = len(token_ids) // block_size
        while len(self.hashes) < num_full:
            i = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else None
            block = token_ids[i * block_size : (i + 1) * block_size]
            # Extra keys enter the first block only: the chain carries them to every later block.
            extra = self.extra_keys if i == 0 else None
            self.hashes.append(hash_block_tokens(parent, block, extra))
        return self.hashes
