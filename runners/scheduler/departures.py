"""Replay an openb pod list in time: pods arrive, wait in a queue when they do not fit, run, and leave.

The 130 %-arrived replay (`replay.py`) places pods once and never lets one go, as the paper did. A
production cluster lives in this setting instead: each pod arrives at its `creation_time`, runs for
`deletion_time - creation_time` seconds from the moment it starts, and waits in the queue until it
fits. What it measures, for any placement policy and with or without defragmentation:

* queueing delay: mean and p99 over every pod, a pod that never started counted with the time it had
  waited when the replay ended (so a policy cannot look good by starving its hardest pods), and how
  many never started. A pod that would not fit even on the empty cluster (the gpuspec lists have a
  few: more CPU than any node of the GPU models they accept) never joins the queue: it is counted as
  unplaceable and left out of the delays, as no policy could ever start it;
* GPU allocation over time: its time-weighted mean while pods were arriving or waiting (from the
  first arrival to the last start) and a sampled series for plots;
* the share of GPU-hours delivered while the work arrived: the GPU-seconds run by the last arrival,
  over what a cluster with room for every pod would have run by then;
* with defragmentation, the moves, per 1,000 pods, and the GPU-seconds they cost.

The load. The openb lists, replayed at their own times, keep at most about 1 % of the cluster's GPUs
busy (6,212 GPUs; their pods arrive over 149 days and half of them run under ten minutes), so nothing
ever queues and every policy scores the same; compressing the arrivals so the GPU-seconds asked fill
the cluster does not change that either, because a few pods that run for weeks hold most of those
GPU-seconds. What makes a queue is many pods at once: `arrive_within` compresses the arrival times
linearly into that many seconds, durations kept, and `tune` inflates the list as the paper's replay
does (1.3: requests for 130 % of the cluster's GPUs). With both, the cluster fills as in the 130 %
replay and then lives on its departures: the pods that did not fit wait for short pods to leave.
`arrive_within` None replays the times as they are.

The queue. First come, first served with backfill: whenever pods leave, the `backfill` oldest waiting
pods are tried in order, each placed by the policy if it fits now; a pod arriving at a non-empty
queue is tried at once too (it can only take what the queued pods cannot use). With `defrag`, for each of
the `DEFRAG_PLAN_TRIES` oldest waiting pods that still do not fit after a departure,
`defrag.plan_room` may move up to `DEFRAG_MAX_MOVES_PER_POD` running pods to make room, within the
budget (moves per pod arrived so far); a moved pod loses `move_cost_s` seconds (its checkpoint, stop and restore), so it
leaves that much later, and its GPUs are charged for them.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from .defrag import (
    DEFAULT_DEFRAG_BUDGET,
    DEFAULT_MOVE_COST_S,
    Placements,
    Running,
    apply_plan,
    check_defrag_settings,
    moves_allowed,
    plan_room,
)
from .model import Node, PodRequest
from .openb import TracePod, inflate, replay_cluster
from .policies import FgdPolicy, PolicyName, make_policy, typical_pods

DEFAULT_BACKFILL = 64
# Waiting pods (the oldest) that defragmentation tries to make room for after each departure. One (the
# head alone) moved p99 little: on gpuspec20, seed 42, p99 453 s against 310 s with eight (fgd: 380 s).
DEFRAG_PLAN_TRIES = 8
# Points in the allocation series a result carries (for plots).
SERIES_POINTS = 200
# Longer than the trace itself (149 days) is not a compression.
ARRIVE_WITHIN_MAX_S = 365 * 86_400


@dataclass
class DeparturesResult:
    """What one replay in time measured."""

    policy: str
    trace: str
    seed: int
    arrive_within_s: Optional[float]
    tune: float
    defrag: bool
    total_gpus: int
    pods: int
    pods_started: int
    pods_never_started: int
    pods_unplaceable: int
    wait_mean_s: float
    wait_p99_s: float
    allocation_mean_pct: float
    gpu_hours_asked: float
    gpu_hours_delivered_pct: float
    span_s: float
    moves: int = 0
    moves_per_1000_pods: float = 0.0
    gpu_seconds_lost_to_moves: float = 0.0
    elapsed_s: float = 0.0
    allocation_series: list[tuple[float, float]] = field(default_factory=list)

    def as_dict(self) -> dict:
        """The JSON object the CLI prints."""
        return dict(self.__dict__)


def _times(pods: Sequence[TracePod], trace: str) -> tuple[np.ndarray, np.ndarray]:
    missing = sum(pod.created_s is None or pod.deleted_s is None for pod in pods)
    if missing:
        named = f"the pod list {trace}" if trace else "the pod list"
        raise ValueError(
            f"{named} has no creation_time and deletion_time for {missing} of its {len(pods)} pods; "
            "the departures replay needs both (the multigpu lists have none)"
        )
    created = np.array([pod.created_s for pod in pods], dtype=np.float64)
    # A pod deleted at or before its creation ran for a moment: one second, not nothing.
    duration = np.maximum(np.array([pod.deleted_s for pod in pods], dtype=np.float64) - created, 1.0)
    return created, duration


def _shape(pod: PodRequest) -> tuple:
    return (pod.cpu_milli, pod.memory_mib, pod.num_gpu, pod.gpu_milli, pod.gpu_models)


def scaled_arrivals(created: np.ndarray, arrive_within: Optional[float]) -> np.ndarray:
    """Arrival times from the first one, compressed linearly into `arrive_within` seconds (None: as they are)."""
    arrivals = created - created.min()
    span = float(arrivals.max())
    if arrive_within is None or span == 0:
        return arrivals
    return arrivals * (arrive_within / span)


def departures_replay(
    nodes: Sequence[Node],
    pods: Sequence[TracePod],
    policy_name: PolicyName,
    seed: int,
    *,
    arrive_within: Optional[float] = None,
    tune: float = 0.0,
    trace: str = "",
    defrag: bool = False,
    defrag_budget: float = DEFAULT_DEFRAG_BUDGET,
    move_cost_s: float = DEFAULT_MOVE_COST_S,
    backfill: int = DEFAULT_BACKFILL,
    plan_tries: int = DEFRAG_PLAN_TRIES,
) -> DeparturesResult:
    """Replay the pods in time (module docstring); pure apart from the clock."""
    started_at = time.perf_counter()
    if seed < 0:
        raise ValueError(f"the seed must be 0 or more, got {seed}")
    if arrive_within is not None and not (0 <= arrive_within <= ARRIVE_WITHIN_MAX_S):
        raise ValueError(
            f"--arrive-within is the seconds all pods arrive within, from 0 to {ARRIVE_WITHIN_MAX_S}; got {arrive_within:g}"
        )
    if not (0 <= tune <= 10):
        raise ValueError(f"--tune inflates the pod list to that many times the cluster's GPUs, from 0 to 10; got {tune:g}")
    if backfill < 1:
        raise ValueError(f"--backfill must be 1 or more pods, got {backfill}")
    check_defrag_settings(defrag_budget, move_cost_s)
    _times(pods, trace)
    rng = np.random.default_rng(seed)
    state = replay_cluster(nodes)
    total_gpus = state.total_gpus
    typical = typical_pods([pod.request for pod in pods], [pod.gpu_spec for pod in pods], with_memory=policy_name == "portal")
    if tune > 0:
        pods = inflate(list(pods), total_gpus, tune, rng)
    state.tie_rank = rng.permutation(state.n_nodes)
    placeable: dict[tuple, bool] = {}
    for pod in pods:
        if _shape(pod.request) not in placeable:
            placeable[_shape(pod.request)] = bool(state.feasible(pod.request).size)
    unplaceable = sum(not placeable[_shape(pod.request)] for pod in pods)
    pods = [pod for pod in pods if placeable[_shape(pod.request)]]
    if not pods:
        raise ValueError("no pod of the list fits even on the empty cluster")
    created, duration = _times(pods, trace)
    requests = [pod.request for pod in pods]
    gpu_milli = np.array([pod.total_gpu_milli if pod.gpu_count else 0 for pod in requests], dtype=np.float64)
    arrival = scaled_arrivals(created, arrive_within)
    order = np.lexsort((np.arange(len(pods)), arrival))
    policy = make_policy(policy_name, typical)
    if isinstance(policy, FgdPolicy):
        policy.bind(state)

    cpu_left_at_start, allocated_at_start = state.cpu_left_milli.copy(), state.allocated_gpu_milli()
    start = np.full(len(pods), np.nan)
    ends: list[tuple[float, int]] = []  # (time, pod index) of running pods
    end_of: dict[int, float] = {}
    placed = Placements(state)
    queue: list[int] = []  # pod indices, oldest first
    moves, moved_milli = 0, 0
    used_milli = 0
    area = 0.0
    area_at_last_arrival = 0.0
    # The area and time at the last start: allocation is averaged over the time work waited or arrived.
    busy_area, busy_until = 0.0, 0.0
    last_t = 0.0
    series: list[tuple[float, float]] = []

    def started(index: int, now: float) -> None:
        """The books for a pod placed on `state` and in `placed` at `now`: when it started and will end."""
        nonlocal used_milli, busy_area, busy_until
        busy_area, busy_until = area, now
        start[index] = now
        end_of[index] = now + duration[index]
        heapq.heappush(ends, (end_of[index], index))
        used_milli += gpu_milli[index]

    def run(index: int, row: int, gpus: tuple[int, ...], now: float) -> None:
        state.place(row, requests[index], gpus)
        placed.add(Running(index, requests[index], row, tuple(gpus)))
        started(index, now)

    def try_place(index: int, now: float) -> bool:
        pod = requests[index]
        feasible = state.feasible(pod)
        if not feasible.size:
            return False
        choice = policy.select(state, pod, feasible, rng)
        run(index, choice.row, tuple(choice.gpus), now)
        return True

    def schedule(now: float, arrived: int) -> None:
        nonlocal moves, moved_milli
        kept = []
        for position, index in enumerate(queue):
            if position >= backfill:
                kept.extend(queue[position:])
                break
            if not try_place(index, now):
                kept.append(index)
        queue[:] = kept
        if not (defrag and queue):
            return
        # Room by moves for the oldest waiting pods, within the budget, at most `plan_tries` of them; a
        # shape that found no plan finds none again until a plan changes the cluster.
        no_plan: set[tuple] = set()
        for head in list(queue[:plan_tries]):
            allowed = moves_allowed(defrag_budget, arrived, moves)
            if not allowed:
                return
            if _shape(requests[head]) in no_plan:
                continue
            plan = plan_room(state, requests[head], placed, max_moves=allowed)
            if plan is None:
                no_plan.add(_shape(requests[head]))
                continue
            no_plan.clear()
            apply_plan(state, requests[head], plan, placed, key=head)
            for move in plan.moves:
                index = move.running.key
                # Stopped, checkpointed and restored: it finishes move_cost_s later, holding its GPUs meanwhile.
                end_of[index] += move_cost_s
                heapq.heappush(ends, (end_of[index], index))
            moves += len(plan.moves)
            moved_milli += plan.moved_gpu_milli
            queue.remove(head)
            started(head, now)

    def advance(now: float) -> None:
        nonlocal area, last_t
        area += used_milli * (now - last_t)
        last_t = now

    next_arrival = 0
    arrived = 0
    sample_every = max(len(pods) // SERIES_POINTS, 1)
    while next_arrival < len(order) or ends:
        t_arrival = arrival[order[next_arrival]] if next_arrival < len(order) else np.inf
        t_end = ends[0][0] if ends else np.inf
        if t_end <= t_arrival:
            now, index = heapq.heappop(ends)
            if end_of.get(index) != now or index not in placed:
                continue  # an end pushed back by a move; the later entry stands
            advance(now)
            running = placed[index]
            placed.remove(running)
            state.release(running.row, running.pod, running.gpus)
            used_milli -= gpu_milli[index]
            del end_of[index]
            # Pods ending at the same moment leave together before the queue is tried.
            while ends and end_of.get(ends[0][1]) != ends[0][0]:
                heapq.heappop(ends)  # stale: an end a move pushed back
            if ends and ends[0][0] == now:
                continue
            schedule(now, arrived)
        else:
            now = float(t_arrival)
            advance(now)
            area_at_last_arrival = area
            index = int(order[next_arrival])
            next_arrival += 1
            arrived += 1
            if queue or not try_place(index, now):
                if not (queue and len(queue) < backfill and try_place(index, now)):
                    queue.append(index)
                    if len(queue) == 1:
                        schedule(now, arrived)
            if arrived % sample_every == 0:
                series.append((round(now, 1), round(100 * used_milli / 1000 / total_gpus, 2)))
        if not ends and next_arrival >= len(order):
            break
    end_time = last_t
    # Every pod that started has left, once: the cluster is as empty as it began. A move that lost a pod
    # or ran one twice would leave something held (or give back more than was taken, which `release`
    # refuses).
    if len(placed) or (state.cpu_left_milli != cpu_left_at_start).any() or state.allocated_gpu_milli() != allocated_at_start:
        raise RuntimeError("the replay ended with resources still held: a pod was lost or run twice")
    if np.isnan(start).any():
        busy_area, busy_until = area, end_time
    waits = np.where(np.isnan(start), end_time - arrival, start - arrival)
    asked = float((gpu_milli * duration).sum())
    # Delivered while the work was arriving: GPU-seconds run by the last arrival, over what a cluster
    # with room for everything would have run by then (each pod from its arrival, for its duration).
    horizon = float(arrival.max())
    ideal = float((gpu_milli * np.minimum(duration, horizon - arrival)).sum())
    span = float(end_time) if end_time > 0 else 1.0
    elapsed = time.perf_counter() - started_at
    return DeparturesResult(
        policy=policy_name,
        trace=trace,
        seed=seed,
        arrive_within_s=arrive_within,
        tune=tune,
        defrag=defrag,
        total_gpus=total_gpus,
        pods=len(pods),
        pods_started=int((~np.isnan(start)).sum()),
        pods_never_started=int(np.isnan(start).sum()),
        pods_unplaceable=unplaceable,
        wait_mean_s=round(float(waits.mean()), 1),
        wait_p99_s=round(float(np.percentile(waits, 99)), 1),
        allocation_mean_pct=round(100 * busy_area / 1000 / total_gpus / busy_until, 2) if busy_until > 0 else 0.0,
        gpu_hours_asked=round(asked / 1000 / 3600, 1),
        gpu_hours_delivered_pct=round(100 * area_at_last_arrival / ideal, 2) if ideal > 0 else 100.0,
        span_s=round(span, 1),
        moves=moves,
        moves_per_1000_pods=round(1000 * moves / len(pods), 2),
        gpu_seconds_lost_to_moves=round(moved_milli / 1000 * move_cost_s, 1),
        elapsed_s=round(elapsed, 2),
        allocation_series=series,
    )
