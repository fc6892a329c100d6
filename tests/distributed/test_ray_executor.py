"""The Ray executor on a one-node Ray cluster the test starts on this host: TP=2 gives one process's tokens."""
from __future__ import annotations

import psutil
import pytest
from parallel_cases import generate, make_edge_model, prompts

ray = pytest.importorskip("ray")


@pytest.mark.slow
def test_tp2_on_ray_greedy_tokens_equal_one_process(tmp_path):
    path = make_edge_model("llama", tmp_path / "llama")
    ids = prompts()
    one = generate(path, ids)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert generate(path, ids, tensor_parallel_size=2, distributed_executor_backend="ray") == one
        # Shutdown removed the placement group (Ray removes it in the background).
        groups = ray.util.placement_group_table().values()
        assert len(groups) == 1 and next(iter(groups))["state"] == "REMOVED"
    finally:
        ray.shutdown()
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    gone, alive = psutil.wait_procs(left, timeout=15)
    assert not alive, f"processes left after ray.shutdown(): {[p.cmdline() for p in alive]}"
