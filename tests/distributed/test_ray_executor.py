"""The Ray executor on a one-node Ray cluster the test starts on this host: TP=2 and PP=2 give one process's tokens."""
from __future__ import annotations

import psutil
import pytest
from parallel_cases import generate, make_edge_model, prompts

ray = pytest.importorskip("ray")


@pytest.mark.slow
def test_tp2_and_pp2_on_ray_greedy_tokens_equal_one_process(tmp_path):
    path = make_edge_model("llama", tmp_path / "llama")
    ids = prompts()
    one = generate(path, ids)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert generate(path, ids, tensor_parallel_size=2, distributed_executor_backend="ray") == one
        # PP=2: two batches in flight, queued at the actors.
        assert generate(path, ids, pipeline_parallel_size=2, distributed_executor_backend="ray") == one
        # Shutdown removed the placement groups (Ray removes them in the background).
        groups = list(ray.util.placement_group_table().values())
        assert len(groups) == 2 and all(g["state"] == "REMOVED" for g in groups)
    finally:
        ray.shutdown()
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    gone, alive = psutil.wait_procs(left, timeout=15)
    assert not alive, f"processes left after ray.shutdown(): {[p.cmdline() for p in alive]}"
