"""DPRouter's choices: least outstanding work, prefix affinity, and escape from an overloaded home."""
from __future__ import annotations

import pytest

from pagedllm.engine.dp_router import DPRouter


def test_least_loaded_with_lowest_index_on_ties():
    r = DPRouter(3, block_size=4)
    assert r.add("a", [1, 2, 3]) == 0  # all idle: lowest index
    assert r.add("b", [5, 6]) == 1
    assert r.add("c", [7]) == 2
    # Loads are now 0: 3+1, 1: 2+1, 2: 1+1 -> core 2.
    assert r.load(0) == 4 and r.load(1) == 3 and r.load(2) == 2
    assert r.add("d", [9, 9, 9, 9, 9]) == 2


def test_started_and_finished_release_load():
    r = DPRouter(2, block_size=4)
    r.add("a", list(range(3)))  # core 0, load 3 + 1
    r.started("a")
    assert r.load(0) == 1  # running only
    assert r.add("b", [50, 51]) == 1  # core 1 load 0 < 1
    assert r.finished("a") == 0 and r.load(0) == 0
    assert r.finished("a") is None
    assert r.add("c", [60]) == 0
    assert r.core_of("c") == 0 and r.requests_on(1) == ["b"]


def test_prefix_affinity_goes_home_while_not_overloaded():
    r = DPRouter(2, block_size=4, max_imbalance=10)
    shared = [11, 12, 13, 14, 15, 16, 17, 18]
    assert r.add("a", shared + [1]) == 0
    # Core 0 now has load 10, core 1 has 0: the shared prefix still goes to core 0 (10 - 0 <= 10).
    assert r.add("b", shared + [2]) == 0
    # A prompt without the prefix goes to the least-loaded core.
    assert r.add("c", [99, 98, 97, 96, 95]) == 1


def test_overloaded_home_escapes_and_moves_the_prefix():
    r = DPRouter(2, block_size=4, max_imbalance=5)
    shared = [21, 22, 23, 24]
    assert r.add("a", shared + [1, 2, 3]) == 0  # core 0 load 8
    assert r.add("b", shared + [4]) == 1  # 8 - 0 > 5: escape to core 1, which becomes home
    r.finished("a")
    r.started("b")  # core 1 load 1, core 0 idle
    assert r.add("c", shared + [5]) == 1  # home is core 1 now (1 - 0 <= 5), although core 0 is idle


def test_short_prompt_has_no_affinity_key():
    r = DPRouter(2, block_size=4)
    assert r.prefix_key([1, 2, 3]) is None
    assert r.prefix_key([1, 2, 3, 4]) == r.prefix_key([1, 2, 3, 4, 7])
    assert r.prefix_key([1, 2, 3, 4]) != r.prefix_key([1, 2, 3, 5])


def test_bad_sizes_and_duplicate_ids():
    with pytest.raises(ValueError, match="num_cores must be >= 1, got 0"):
        DPRouter(0, block_size=16)
    r = DPRouter(2, block_size=16)
    r.add("x", [1])
    with pytest.raises(ValueError, match="'x' is already routed"):
        r.add("x", [1])
