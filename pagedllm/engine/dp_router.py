"""DPRouter: picks the data-parallel engine core for each new request (pure Python, no processes).

Load of a core = prompt tokens it has been sent but not yet started + requests it is running; a
new request goes to the least-loaded core (lowest index on ties). Prefix affinity: the hash of the
prompt's first full blocks (the prefix cache's block size and sha256 chain) remembers the core that
last served that prefix, and a request with the same prefix goes there, because only that core holds
its KV blocks, unless that core's load exceeds the least-loaded one's by more than `max_imbalance`
(then it escapes to the least-loaded core, which becomes the prefix's new home).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from pagedllm.core.hashing import hash_block_tokens

# How many full blocks of a prompt make its affinity key: enough for a shared system prompt, and
# cheap to hash for every request.
AFFINITY_BLOCKS = 4
# Prefixes remembered, oldest forgotten first: bounds the front-end's memory on unique prompts.
MAX_REMEMBERED_PREFIXES = 65536


@dataclass
class _Outstanding:
    core: int
    queued_tokens: int  # prompt tokens not yet started (0 once the first output arrived)


class DPRouter:
    def __init__(self, num_cores: int, block_size: int, max_imbalance: int = 256) -> None:
        if num_cores < 1:
            raise ValueError(f"num_cores must be >= 1, got {num_cores}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_cores = num_cores
        self.block_size = block_size
        self.max_imbalance = max_imbalance
        self.queued_tokens = [0] * num_cores
        self.num_routed = [0] * num_cores  # requests ever sent to each core
        self.running = [0] * num_cores
        self._requests: dict[str, _Outstanding] = {}
        self._prefix_home: OrderedDict[bytes, int] = OrderedDict()

    def load(self, core: int) -> int:
        return self.queued_tokens[core] + self.running[core]

    def core_of(self, request_id: str) -> int | None:
        r = self._requests.get(request_id)
        return None if r is None else r.core

    def prefix_key(self, prompt_token_ids: Sequence[int]) -> bytes | None:
        """The chained hash of the first AFFINITY_BLOCKS full blocks; None for a prompt under one block."""
        num_full = min(len(prompt_token_ids) // self.block_size, AFFINITY_BLOCKS)
        h = None
        for i in range(num_full):
            h = hash_block_tokens(h, prompt_token_ids[i * self.block_size : (i + 1) * self.block_size])
        return h

    def choose(self, prompt_token_ids: Sequence[int]) -> int:
        """The core for a prompt, without recording anything (see add)."""
        loads = [self.load(i) for i in range(self.num_cores)]
        least = min(range(self.num_cores), key=lambda i: (loads[i], i))
        key = self.prefix_key(prompt_token_ids)
        home = self._prefix_home.get(key) if key is not None else None
        if home is not None and loads[home] - loads[least] <= self.max_imbalance:
            return home
        return least

    def add(self, request_id: str, prompt_token_ids: Sequence[int]) -> int:
        """Chooses a core for the request, counts its load there and makes it the prefix's home."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already routed")
        core = self.choose(prompt_token_ids)
        self._requests[request_id] = _Outstanding(core, len(prompt_token_ids))
        self.queued_tokens[core] += len(prompt_token_ids)
        self.running[core] += 1
        self.num_routed[core] += 1
        key = self.prefix_key(prompt_token_ids)
        if key is not None:
            self._prefix_home[key] = core
            self._prefix_home.move_to_end(key)
            if len(self._prefix_home) > MAX_REMEMBERED_PREFIXES:
                self._prefix_home.popitem(last=False)
        return core

    def started(self, request_id: str) -> None:
        """The request produced its first output: its prompt is no longer queued work."""
        r = self._requests.get(request_id)
        if r is not None and r.queued_tokens:
            self.queued_tokens[r.core] -= r.queued_tokens
            r.queued_tokens = 0

    def finished(self, request_id: str) -> int | None:
        """Forgets a finished or aborted request; returns the core it was on (None if unknown)."""
        r = self._requests.pop(request_id, None)
        if r is None:
            return None
        self.queued_tokens[r.core] -= r.queued_tokens
        self.running[r.core] -= 1
        return r.core

    def requests_on(self, core: int) -> list[str]:
        return [rid for rid, r in self._requests.items() if r.core == core]
