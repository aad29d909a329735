"""The stream replay with node caches, and the cache-placement bench run small on the demo cluster."""

import argparse

import pytest

from bench import cache_placement
from runners.scheduler.cache_replay import NodeCache, replay_stream, synthetic_datasets, synthetic_stream
from runners.scheduler.model import Gpu, Node, PodRequest

pytestmark = pytest.mark.unit

GIB = 1 << 30


def _shards(*names, size=GIB):
    return [(name, size) for name in names]


def test_a_node_cache_evicts_the_least_recently_used_shard_no_job_reads():
    changes = []
    cache = NodeCache(3 * GIB, on_change=lambda sha, delta: changes.append((sha, delta)))
    assert cache.fill(_shards("a", "b")) == 2 * GIB
    cache.release(_shards("a", "b"))
    assert cache.fill(_shards("a")) == 0  # a hit: "a" is now the most recently used
    cache.release(_shards("a"))
    assert cache.fill(_shards("c", "d")) == 2 * GIB  # room for one more: "b", the oldest, goes
    assert set(cache.shards) == {"a", "c", "d"} and cache.used_bytes == 3 * GIB
    assert ("b", -GIB) in changes and sum(delta for _, delta in changes) == cache.used_bytes


def test_a_node_cache_never_evicts_a_shard_a_running_job_reads():
    cache = NodeCache(2 * GIB)
    cache.fill(_shards("a", "b"))  # running: pinned
    assert cache.fill(_shards("c")) == GIB  # read through: nothing it could evict
    assert set(cache.shards) == {"a", "b"}
    cache.release(_shards("a", "b"))
    cache.release(_shards("c"))
    assert cache.fill(_shards("c")) == GIB and set(cache.shards) == {"b", "c"}
    with pytest.raises(ValueError, match="released more often"):
        cache.release(_shards("a", "a"))


def _tiny_cluster():
    return [Node(f"n{index}", 64000, 262144, [Gpu("T4") for _ in range(4)]) for index in range(4)]


def test_the_replay_places_every_job_and_accounts_every_byte():
    nodes = _tiny_cluster()
    datasets = synthetic_datasets(6, 4, GIB)
    shapes = [((PodRequest("p", 4000, 8192, 1, 1000),), "none", False, 1.0),
              ((PodRequest("q", 4000, 8192, 2, 1000),) * 2, "node", False, 0.5)]
    stream = synthetic_stream(shapes, jobs=400, datasets=6, total_gpus=16, load=0.8, mean_runtime_s=600, zipf_s=1.0,
                              seed=3)
    for aware in (False, True):
        result = replay_stream(nodes, datasets, stream, cache_aware=aware, cache_bytes_per_node=8 * GIB,
                               bandwidth_bytes_per_s=GIB, seed=3)
        assert result.jobs_placed == result.jobs == 400
        assert 0 < result.bytes_pulled <= result.bytes_needed
        assert len(result.fetch_s) == 400 and max(result.fetch_s) <= 4.0  # a node pulls at most one dataset, 4 GiB
        assert 0 < result.allocation_pct <= 100


def test_the_bench_run_small_pulls_less_cache_aware_at_the_same_allocation():
    """The suite's short form of bench/cache_placement.py: the demo cluster, one seed, 600 jobs."""
    args = argparse.Namespace(jobs_demo=600, datasets=16, shards=16, shard_mib=1024, cache_gib=48, bandwidth_gib_s=1.0,
                              zipf=1.0, load=0.9, runtime_min=60, pass_limit=64, tolerance=0)
    blind, aware = cache_placement.run("demo", 1, args)
    assert (blind["cache_aware"], aware["cache_aware"]) == (False, True)
    assert blind["jobs_placed"] == aware["jobs_placed"] == 600
    assert aware["bytes_pulled"] < blind["bytes_pulled"]
    assert aware["ttfs_s_mean"] < blind["ttfs_s_mean"]
    assert abs(aware["allocation_pct"] - blind["allocation_pct"]) <= 0.5
    assert "cache-aware" in cache_placement.report([blind, aware])
