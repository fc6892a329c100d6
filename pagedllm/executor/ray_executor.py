"""RayExecutor (``ray``): one Ray actor per rank, placed by a placement group that may span a Ray cluster's nodes.

Each actor runs the same rank body as an mp worker process (executor/rank_worker.py) and is fed the same
msgpack messages, one actor call per message. The placement group reserves one bundle per rank (a GPU,
or a CPU for the CPU path) with the strategy in ``PAGEDLLM_RAY_PLACEMENT_STRATEGY`` (PACK by default:
as few nodes as fit). The ranks meet over torch.distributed at a free port on rank 0's node.

A cluster already joined (``ray.init`` called, or ``RAY_ADDRESS`` set, or one started by ``ray start`` on
this host) is used as it is; otherwise a local one is started and stopped with the executor. A rank that
raises or whose actor dies stops every actor and raises ``WorkerFailedError`` naming the rank.
"""
from __future__ import annotations

import logging
import os
import socket
import time

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.executor import messages as m
from pagedllm.executor.rank_executor import RankExecutor
from pagedllm.executor.rank_worker import RankWorker

logger = logging.getLogger("pagedllm")

# How long the placement group may wait for resources, and a rank to load its shard and join the others.
_START_TIMEOUT_S = 600.0
# How long shutdown waits for the ranks to leave their process group.
_JOIN_TIMEOUT_S = 5.0
# How long an idle health check waits for each actor to answer.
_PING_TIMEOUT_S = 30.0


class _RankActor:
    """The actor body: a RankWorker whose failures come back as ``Failed`` answers, as over mp's pipe."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s rank {rank}: %(message)s",
                            datefmt="%H:%M:%S")
        # Ray shows a GPU actor only its own GPU, so the rank's device is the first one it sees.
        self.body = RankWorker(config, rank, local_rank=0)

    def rendezvous(self) -> str:
        """``tcp://ip:port`` on this actor's node, a port free there now (rank 0 listens on it)."""
        import ray

        # The address this node joined the cluster with (127.0.0.1 for a loopback cluster), not a guess
        # from the host's interfaces.
        node_id = ray.get_runtime_context().get_node_id()
        ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id),
                  ray.util.get_node_ip_address())
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return f"tcp://{ip}:{port}"

    def start(self, init_method: str) -> bytes:
        try:
            return self.body.start(init_method)
        except BaseException as e:  # noqa: BLE001 - reported to the executor as mp reports it
            logger.exception("worker failed")
            return self.body.failed(e)

    def handle(self, data: bytes) -> bytes | None:
        try:
            return self.body.handle(data)
        except BaseException as e:  # noqa: BLE001 - reported to the executor as mp reports it
            logger.exception("worker failed")
            return self.body.failed(e)

    def ping(self) -> int:
        return os.getpid()


class RayExecutor(RankExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        try:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as e:
            raise ImportError("distributed_executor_backend='ray' needs Ray: pip install 'pagedllm[ray]'") from e
        self._ray = ray
        self._remove_pg = remove_placement_group
        self._encoder = m.msgspec.msgpack.Encoder()
        self._decoder = m.output_decoder()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            # Joins RAY_ADDRESS or a cluster `ray start` left on this host, else starts a local one.
            ray.init(include_dashboard=False, log_to_driver=True)
        cuda = config.device_config.device == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}
        strategy = envs.PAGEDLLM_RAY_PLACEMENT_STRATEGY
        self.pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy=strategy)
        self.actors: list = []
        try:
            if not self._wait(self.pg.ready(), _START_TIMEOUT_S):
                raise RuntimeError(f"Ray could not place {self.world_size} bundles of {bundle} with strategy "
                                   f"{strategy} within {_START_TIMEOUT_S:.0f} s; cluster resources: "
                                   f"{ray.cluster_resources()}")
            actor_cls = ray.remote(_RankActor)
            for rank in range(self.world_size):
                opts = dict(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), name=None,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(
                                placement_group=self.pg, placement_group_bundle_index=rank))
                self.actors.append(actor_cls.options(**opts).remote(config, rank))
            init_method = self._get(0, self.actors[0].rendezvous.remote(), _START_TIMEOUT_S)
            ready = self._collect([a.start.remote(init_method) for a in self.actors], _START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        nodes = ray.util.placement_group_table(self.pg).get("bundles_to_node_id", {})
        logger.info("%d Ray workers ready (pids %s), rendezvous %s; rank -> node %s", self.world_size,
                    ", ".join(str(r.pid) for r in ready), init_method,
                    {r: str(nodes.get(r, "?"))[:8] for r in range(self.world_size)})

    # ---- calls ----------------------------------------------------------------------------------------
    def _wait(self, ref, timeout_s: float) -> bool:
        ready, _ = self._ray.wait([ref], timeout=timeout_s)
        return bool(ready)

    def _get(self, rank: int, ref, timeout_s: float | None):
        try:
            return self._ray.get(ref, timeout=timeout_s)
        except self._ray.exceptions.GetTimeoutError:
            self._fail(rank, f"no answer within {timeout_s:.0f} s")
        except self._ray.exceptions.RayError as e:
            self._fail(rank, f"actor died: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    def _send(self, msg) -> list:
        """One actor call per rank; their results are the answers."""
        return self._broadcast(msg)

    def _answers(self, handle) -> list:
        return self._collect(handle)

    def _broadcast(self, msg) -> list:
        self._raise_if_failed()
        data = self._encoder.encode(msg)
        return [a.handle.remote(data) for a in self.actors]

    def _collect(self, refs: list, timeout_s: float | None = None) -> list:
        """Every rank's answer, in rank order; the first failure or death (in arrival order) fails all."""
        rank_of = {ref: r for r, ref in enumerate(refs)}
        answers: dict[int, object] = {}
        pending = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = self._ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                self._fail(rank_of[pending[0]], f"no answer within {timeout_s:.0f} s")
            r = rank_of[ready[0]]
            msg = self._decoder.decode(self._get(r, ready[0], None))
            if isinstance(msg, m.Failed):
                self._fail(r, msg.summary)
            answers[r] = msg
        return [answers[r] for r in range(len(refs))]

    def _stop_ranks(self) -> None:
        self._kill_actors()

    def _kill_actors(self) -> None:
        for actor in self.actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []

    # ---- the Executor interface ---------------------------------------------------------------------
    def check_health(self) -> None:
        self._raise_if_failed()
        for rank, actor in enumerate(self.actors):
            self._get(rank, actor.ping.remote(), _PING_TIMEOUT_S)

    def shutdown(self) -> None:
        ray = self._ray
        if self._failed is None and self.actors:
            data = self._encoder.encode(m.Shutdown())
            refs = [a.handle.remote(data) for a in self.actors]
            ray.wait(refs, num_returns=len(refs), timeout=_JOIN_TIMEOUT_S)
        self._kill_actors()
        if getattr(self, "pg", None) is not None:
            try:
                self._remove_pg(self.pg)
            except Exception:  # noqa: BLE001 - the cluster is already gone
                pass
            self.pg = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False
