"""Replay a stream of jobs that read datasets over nodes with shard caches: what cache-aware placement buys.

The openb replay (`replay.py`) places pods that never leave, so a node's cache would never be
reused. Here jobs arrive, wait in a queue, are placed, read their dataset, run and leave, and each
node keeps a bounded cache of shards, as the portal's node caches do:

* Datasets: `Dataset` (a name and its shards, each a content hash and a size).
* Jobs: `StreamJob` (a gang of pods, the dataset it reads, when it is submitted, how long it runs).
* A scheduling pass at every moment something arrives or leaves: the first `pass_limit` queued
  jobs, oldest first, go through `placement.place_gangs_on` on one cluster state kept for the
  whole stream (pods that leave give their share back through `ClusterState.release`), with one
  policy (its per-node score caches hold across passes). Cache-aware, each gang carries the bytes
  of its dataset every node holds at the start of the pass (`Gang.cached_bytes`), as the portal's
  cycle reads them from the node caches' rows; cache-blind, it carries none.
* Once placed, every node a job landed on fills its cache with the dataset's shards (prefetch
  before the ranks start): shards it holds are hits, the rest are pulled from storage and cached,
  least recently used shards evicted first, never a shard a running job on that node reads (when
  every shard is in use, the new one is read through and not kept). The job's first step comes
  when its slowest node has pulled what it lacked: pulled bytes / `bandwidth_bytes_per_s` per node
  (storage's total bandwidth is not modelled as a limit).
* Time to first step is that fetch, from the moment the job is placed (what placement changes);
  the wait in the queue before it is reported apart. Allocation is the share of the
  cluster's GPU milli held by placed jobs, averaged over time from the end of the warm-up
  (`warmup_runtimes` mean runtimes after the first arrival, once the cluster has filled) to the
  last arrival, so neither the filling nor the stream's tail, when the queue runs dry, counts.

Pure apart from the clock (the elapsed time it reports); one seed gives the same figures anywhere.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .model import GPU_MILLI, ClusterState, Gang, Node, PodRequest, Topology
from .placement import CACHE_TOLERANCE_POINTS, place_gangs_on
from .policies import PolicyName, make_policy, typical_pods


@dataclass(frozen=True)
class Dataset:
    """A sealed dataset version as the cache sees it: its shards, (sha256, bytes) each."""

    name: str
    shards: tuple[tuple[str, int], ...]

    @property
    def bytes(self) -> int:
        """The dataset's size in all."""
        return sum(size for _, size in self.shards)


@dataclass(frozen=True)
class StreamJob:
    """One job of the stream: a gang of pods reading one dataset."""

    name: str
    pods: tuple[PodRequest, ...]
    dataset: int  # index into the replay's datasets
    submit_s: float
    runtime_s: float
    topology: Topology = "none"
    required: bool = False

    @property
    def gpu_milli(self) -> int:
        """GPU milli the job holds while it runs."""
        return sum(pod.total_gpu_milli for pod in self.pods if pod.gpu_count)


class NodeCache:
    """One node's shard cache: bounded, least recently used first out, never a shard in use.

    `pins` counts the running jobs on the node reading each shard; a pinned shard is never evicted.
    The shards no job reads wait in `evictable`, in the order they were last used (filled, or
    released by the last job reading them), so an eviction takes the oldest without looking at
    the pinned ones. `on_change(sha256, delta)` hears every byte cached or evicted, so the replay
    can keep each dataset's bytes per node without rescanning caches.
    """

    def __init__(self, capacity_bytes: int, on_change=None):
        if capacity_bytes < 0:
            raise ValueError(f"a node cache's capacity must be 0 bytes or more, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.shards: dict[str, int] = {}
        self.evictable: OrderedDict[str, int] = OrderedDict()  # oldest use first
        self.evictable_bytes = 0
        self.pins: dict[str, int] = defaultdict(int)
        self.on_change = on_change

    def _evict_for(self, size: int) -> bool:
        """Make room for `size` bytes, evicting unpinned shards oldest first; False (and nothing
        evicted) when even evicting all of them would not."""
        if self.used_bytes - self.evictable_bytes + size > self.capacity_bytes:
            return False
        while self.used_bytes + size > self.capacity_bytes:
            sha, held = self.evictable.popitem(last=False)
            self.evictable_bytes -= held
            del self.shards[sha]
            self.used_bytes -= held
            if self.on_change:
                self.on_change(sha, -held)
        return True

    def fill(self, shards: Sequence[tuple[str, int]]) -> int:
        """Prefetch a job's shards and pin them for it; returns the bytes pulled from storage.

        A shard that cannot be kept (the cache full of shards in use) is pulled and read through."""
        pulled = 0
        for sha, _ in shards:
            self.pins[sha] += 1
            held = self.evictable.pop(sha, None)
            if held is not None:
                self.evictable_bytes -= held
        for sha, size in shards:
            if sha in self.shards:
                continue
            pulled += size
            if self._evict_for(size):
                self.shards[sha] = size
                self.used_bytes += size
                if self.on_change:
                    self.on_change(sha, size)
        return pulled

    def release(self, shards: Sequence[tuple[str, int]]) -> None:
        """The job that pinned these shards has ended here: a shard no job reads now may be evicted."""
        for sha, _ in shards:
            left = self.pins[sha] - 1
            if left < 0:
                raise ValueError(f"shard {sha[:12]} released more often than it was filled")
            if left:
                self.pins[sha] = left
                continue
            del self.pins[sha]
            held = self.shards.get(sha)
            if held is not None:
                self.evictable[sha] = held
                self.evictable_bytes += held


@dataclass
class CacheReplayResult:
    """What one stream replay measured."""

    cache_aware: bool
    seed: int
    jobs: int
    jobs_placed: int
    total_gpus: int
    bytes_needed: int  # every node's share of every placed job's dataset
    bytes_pulled: int  # of those, what came from storage
    fetch_s: list[float] = field(repr=False)  # per placed job, its slowest node's pull
    wait_s: list[float] = field(repr=False)  # per placed job, submit to placement
    allocation_pct: float = 0.0
    elapsed_s: float = 0.0

    @property
    def hit_pct(self) -> float:
        """Share of the bytes placed jobs needed that their nodes' caches held."""
        return 100.0 * (1 - self.bytes_pulled / self.bytes_needed) if self.bytes_needed else 0.0

    def summary(self) -> dict:
        """The figures, as the bench prints and stores them."""
        ttfs, wait = np.array(self.fetch_s or [0.0]), np.array(self.wait_s or [0.0])
        return {
            "cache_aware": self.cache_aware, "seed": self.seed, "jobs": self.jobs, "jobs_placed": self.jobs_placed,
            "total_gpus": self.total_gpus, "bytes_needed": self.bytes_needed, "bytes_pulled": self.bytes_pulled,
            "hit_pct": round(self.hit_pct, 2), "allocation_pct": round(self.allocation_pct, 3),
            "ttfs_s_mean": round(float(ttfs.mean()), 2), "ttfs_s_p50": round(float(np.percentile(ttfs, 50)), 2),
            "ttfs_s_p90": round(float(np.percentile(ttfs, 90)), 2),
            "zero_pull_pct": round(100.0 * float((ttfs == 0).mean()), 2),
            "wait_s_mean": round(float(wait.mean()), 2), "elapsed_s": round(self.elapsed_s, 2),
        }


def replay_stream(
    nodes: Sequence[Node],
    datasets: Sequence[Dataset],
    jobs: Sequence[StreamJob],
    *,
    cache_aware: bool,
    cache_bytes_per_node: int,
    bandwidth_bytes_per_s: float,
    policy_name: PolicyName = "portal",
    seed: int = 0,
    pass_limit: int = 64,
    warmup_runtimes: float = 2.0,
    cache_tolerance_points: float = CACHE_TOLERANCE_POINTS,
) -> CacheReplayResult:
    """Replay the stream (jobs in submit order) once, cache-aware or cache-blind; see the module's note."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"the bandwidth must be above 0 bytes/s, got {bandwidth_bytes_per_s}")
    if any(pod.kind == "mig" for job in jobs for pod in job.pods):
        raise ValueError("the stream replay gives GPUs back through ClusterState.release, which takes no MIG slices")
    started = time.perf_counter()
    jobs = sorted(jobs, key=lambda job: job.submit_s)
    state = ClusterState(list(nodes))
    state.tie_rank = np.random.default_rng(seed).permutation(state.n_nodes)
    total_milli = state.total_gpus * GPU_MILLI
    policy = make_policy(policy_name, typical_pods([pod for job in jobs for pod in job.pods],
                                                   with_memory=policy_name == "portal"))

    # Each dataset's bytes per node, kept as caches fill and evict (dataset -> node name -> bytes).
    dataset_of_shard = {sha: index for index, dataset in enumerate(datasets) for sha, _ in dataset.shards}
    held: list[dict[str, int]] = [defaultdict(int) for _ in datasets]

    def cache_for(name: str) -> NodeCache:
        def on_change(sha: str, delta: int) -> None:
            dataset = held[dataset_of_shard[sha]]
            dataset[name] += delta
            if not dataset[name]:
                del dataset[name]
        return NodeCache(cache_bytes_per_node, on_change)

    caches = {node.name: cache_for(node.name) for node in nodes}

    queue: list[int] = []  # indices into jobs, oldest first
    departures: list[tuple[float, int]] = []  # (time, job index), a heap
    running: dict[int, list] = {}  # job index -> its placements
    fetch_s: list[float] = []
    wait_s: list[float] = []
    bytes_needed = bytes_pulled = placed_jobs = 0
    if not jobs:
        raise ValueError("the stream has no jobs")
    warmup_s = jobs[0].submit_s + warmup_runtimes * float(np.mean([job.runtime_s for job in jobs]))
    end_s = jobs[-1].submit_s
    if warmup_s >= end_s:
        raise ValueError(f"the stream's arrivals end {end_s - jobs[0].submit_s:.0f} s after they start, within its "
                         f"warm-up of {warmup_runtimes:g} mean runtimes: give it more jobs or shorter runtimes")
    allocated_milli, allocation_integral, last_s = 0, 0.0, warmup_s

    def advance(to_s: float) -> None:
        nonlocal allocation_integral, last_s
        if to_s > last_s:
            span_end = min(to_s, end_s)
            if span_end > last_s:
                allocation_integral += allocated_milli * (span_end - last_s)
            last_s = max(last_s, to_s)

    next_job = 0
    while next_job < len(jobs) or departures:
        arrival_s = jobs[next_job].submit_s if next_job < len(jobs) else float("inf")
        departure_s = departures[0][0] if departures else float("inf")
        now = min(arrival_s, departure_s)
        if now == float("inf"):
            break  # what is left queued can never be placed: nothing is running to free room
        advance(now)
        while departures and departures[0][0] <= now:
            _, index = heapq.heappop(departures)
            job = jobs[index]
            shards = datasets[job.dataset].shards
            for placement_node in {placement.node for placement in running[index]}:
                caches[placement_node].release(shards)
            for pod, placement in zip(job.pods, running.pop(index)):
                state.release(state.row_of[placement.node], pod, placement.gpu_indices)
            allocated_milli -= job.gpu_milli
        while next_job < len(jobs) and jobs[next_job].submit_s <= now:
            queue.append(next_job)
            next_job += 1
        considered = queue[:pass_limit]
        gangs = []
        for index in considered:
            job = jobs[index]
            cached = held[job.dataset] if cache_aware else {}
            gangs.append(Gang(job.name, job.pods, job.topology, job.required, cached_bytes=cached))
        decisions = place_gangs_on(state, gangs, policy, seed=seed, cache_tolerance_points=cache_tolerance_points)
        placed_now = set()
        for index, decision in zip(considered, decisions):
            if not decision.placed:
                continue
            job = jobs[index]
            placed_now.add(index)
            shards = datasets[job.dataset].shards
            slowest = 0
            for node_name in dict.fromkeys(placement.node for placement in decision.placements):
                pulled = caches[node_name].fill(shards)
                bytes_pulled += pulled
                bytes_needed += datasets[job.dataset].bytes
                slowest = max(slowest, pulled)
            fetch = slowest / bandwidth_bytes_per_s
            fetch_s.append(fetch)
            wait_s.append(now - job.submit_s)
            running[index] = list(decision.placements)
            heapq.heappush(departures, (now + fetch + job.runtime_s, index))
            allocated_milli += job.gpu_milli
            placed_jobs += 1
        if placed_now:
            queue = [index for index in queue if index not in placed_now]
    span = end_s - warmup_s
    return CacheReplayResult(
        cache_aware=cache_aware, seed=seed, jobs=len(jobs), jobs_placed=placed_jobs, total_gpus=state.total_gpus,
        bytes_needed=bytes_needed, bytes_pulled=bytes_pulled, fetch_s=fetch_s, wait_s=wait_s,
        allocation_pct=100.0 * allocation_integral / (total_milli * span) if span > 0 and total_milli else 0.0,
        elapsed_s=time.perf_counter() - started,
    )


def synthetic_datasets(count: int, shards: int, shard_bytes: int, prefix: str = "ds") -> list[Dataset]:
    """`count` datasets of `shards` shards of `shard_bytes` each, every shard its own content."""
    return [
        Dataset(f"{prefix}-{index}", tuple((f"{prefix}-{index}-shard-{shard:05d}", shard_bytes) for shard in range(shards)))
        for index in range(count)
    ]


def synthetic_stream(
    shapes: Sequence[tuple[tuple[PodRequest, ...], Topology, bool, float]],
    *,
    jobs: int,
    datasets: int,
    total_gpus: int,
    load: float,
    mean_runtime_s: float,
    zipf_s: float,
    seed: int,
) -> list[StreamJob]:
    """A stream of `jobs` jobs: shapes (pods, topology, required, weight) drawn in proportion to their
    weights, datasets by a Zipf law of exponent `zipf_s` (a few datasets popular, most read now and
    then), runtimes exponential with the given mean, and Poisson arrivals at the rate that offers
    `load` times the cluster's GPUs."""
    if not shapes:
        raise ValueError("a stream needs at least one job shape")
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, datasets + 1) ** zipf_s
    popularity /= popularity.sum()
    shape_weights = np.array([shape[3] for shape in shapes], dtype=np.float64)
    picks = rng.choice(len(shapes), size=jobs, p=shape_weights / shape_weights.sum())
    mean_gpus = float(np.mean([sum(p.total_gpu_milli for p in shapes[i][0] if p.gpu_count) / GPU_MILLI for i in picks]))
    rate_per_s = load * total_gpus / max(mean_gpus * mean_runtime_s, 1e-9)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, size=jobs))
    runtimes = rng.exponential(mean_runtime_s, size=jobs)
    dataset_picks = rng.choice(datasets, size=jobs, p=popularity)
    stream = []
    for number, (shape, submit_s, runtime_s, dataset) in enumerate(zip(picks, arrivals, runtimes, dataset_picks)):
        pods, topology, required, _ = shapes[shape]
        name = f"job-{number}"
        stream.append(StreamJob(
            name, tuple(PodRequest(f"{name}-{rank}", pod.cpu_milli, pod.memory_mib, pod.num_gpu, pod.gpu_milli, pod.gpu_models)
                        for rank, pod in enumerate(pods)),
            int(dataset), float(submit_s), float(runtime_s), topology, required,
        ))
    return stream
