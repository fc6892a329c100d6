"""The Ray executor on a local Ray cluster the test starts on 127.0.0.1: TP=2 gives one process's tokens."""
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
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    try:
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        assert generate(path, ids, tensor_parallel_size=2, distributed_executor_backend="ray") == one
        # Shutdown gave the placement group's bundles back to the cluster.
        assert ray.available_resources().get("CPU") == 2
    finally:
        ray.shutdown()
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    gone, alive = psutil.wait_procs(left, timeout=15)
    assert not alive, f"processes left after ray.shutdown(): {[p.cmdline() for p in alive]}"
