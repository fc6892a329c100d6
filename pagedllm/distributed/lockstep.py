"""The data-parallel engine cores' lockstep group: a small gloo group of the K core processes, apart from the
model ranks' world, through which the cores agree each busy-loop iteration whether any of them has work.

Under expert parallelism across the cores every MoE layer is a collective of all their ranks, so each core
must run a model call exactly when the others do. One all-reduce (MAX) of a few flags per iteration gives
every core the same answer; as they all see the same answers, they run the same number of model calls and
go idle (or stop) in the same iteration. The group is its own (a TCPStore at the front-end's port and a
gloo process group built on it): a core process whose model ranks live in worker processes is not in the
model world, and one that is (a single-rank core) has that world as its default group already.
"""
from __future__ import annotations

import datetime
from urllib.parse import urlparse

import torch
import torch.distributed as dist

# Flags a core contributes each iteration, in this order; the group answers each one's maximum.
HAS_WORK, STOP = 0, 1


class LockstepGroup:
    """Core ``rank`` of ``size`` at ``init_method`` (``tcp://127.0.0.1:PORT``; core 0 serves the store)."""

    def __init__(self, init_method: str, rank: int, size: int, timeout_s: float) -> None:
        url = urlparse(init_method)
        if url.scheme != "tcp" or url.hostname is None or url.port is None:
            raise ValueError(f"the lockstep group's address must be tcp://HOST:PORT; got {init_method!r}")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.size = rank, size
        # Every core waits here for all the others: the store's start-up is itself the first meeting.
        self._store = dist.TCPStore(url.hostname, url.port, size, rank == 0, timeout=timeout)
        self._group = dist.ProcessGroupGloo(self._store, rank, size, timeout)
        self._flags = torch.zeros(2, dtype=torch.int64)
        self._opts = dist.AllreduceOptions()
        self._opts.reduceOp = dist.ReduceOp.MAX

    def agree(self, has_work: bool, stop: bool) -> tuple[bool, bool]:
        """(any core has work, any core stops): the same answer on every core. Blocks until all have asked;
        raises when a core is gone (gloo sees its connection close)."""
        self._flags[HAS_WORK], self._flags[STOP] = int(has_work), int(stop)
        self._group.allreduce([self._flags], self._opts).wait()
        return bool(self._flags[HAS_WORK]), bool(self._flags[STOP])
