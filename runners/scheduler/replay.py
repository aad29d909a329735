"""Replay an openb trace the way "Beware of Fragmentation" (ATC'23) did, with any placement policy.

The published procedure (hkust-adsl/kubernetes-scheduler-simulator, `Simulate` and
`TunePodsByNodeTotalResource`):

1. Sort the pods by name and shuffle them with the seed.
2. Inflate ("tune") to `tune` x the cluster's GPUs (`openb.inflate`, which the replay in time shares): append random copies of trace pods, drawn from
   the name-sorted list, until the next copy would push the requested GPUs over the target (the
   simulator compares against the copy's per-GPU milli, not its total; kept as published), or, if
   the trace is already over, remove random pods until it is not.
3. Place the pods one at a time, online; a pod that fits nowhere fails; nothing leaves.
4. After every pod, record allocated GPUs and fragmentation against arrived GPUs (requested so
   far, placed or not), then average the records whose arrived share rounds to each whole percent,
   as the authors' merge scripts do (a percent with no record takes those within +-1).

The shuffle uses numpy's PCG64, not Go's math/rand, so a seed here is not the same permutation as
the same seed there; means over seeds are what compare. Equal scores go to the first node in a
seeded random order, as the simulator's renamed nodes do (see `policies.pick_max`).

With `--defrag`, a pod that fits nowhere may have room made for it by moving pods already placed
(`defrag.plan_room`: at most `DEFRAG_MAX_MOVES_PER_POD` moves, each to where the moved pod fits
tightest), within a budget of moves per pod arrived (`--defrag-budget`, default
`DEFAULT_DEFRAG_BUDGET`: 2 moves per 100 pods). Every placed pod counts as movable (the trace says
nothing of checkpoints). Each move is charged `--move-cost-s` seconds of the GPUs it moves (stopping
with a checkpoint, then restoring elsewhere), reported as GPU-seconds lost to moves.

Usage: python -m runners.scheduler.replay --nodes CSV --pods CSV --policy NAME --seed N [--tune 1.3]
[--mix trace|online] [--window N] [--defrag [--defrag-budget SHARE] [--move-cost-s S]] [--json]
       python -m runners.scheduler.replay ... --departures [--arrive-within S] [--defrag ...]   (departures.py)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Sequence, get_args

import numpy as np

from .batch import place_window
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
from .departures import departures_replay
from .model import Node
from .openb import TracePod, inflate, load_nodes, load_pods, replay_cluster
from .policies import (
    POLICY_NAMES,
    Choice,
    FgdPolicy,
    FragModel,
    OnlineMix,
    PolicyName,
    make_policy,
    prior_pod,
    typical_pods,
)

ARRIVED_PCT_MAX = 130


@dataclass
class ReplayResult:
    """What one replay measured."""

    policy: str
    trace: str
    seed: int
    total_gpus: int
    pods_arrived: int
    pods_placed: int
    pods_failed: int
    allocation_pct_by_arrived: list[Optional[float]]
    fragmentation_pct_by_arrived: list[Optional[float]]
    elapsed_s: float
    pods_per_s: float
    mix: str = "trace"
    window: int = 1
    defrag: bool = False
    defrag_budget: float = 0.0
    moves: int = 0
    moves_per_1000_pods: float = 0.0
    pods_placed_by_moves: int = 0
    gpu_seconds_lost_to_moves: float = 0.0

    def as_dict(self) -> dict:
        """The JSON object the CLI prints."""
        return dict(self.__dict__)


def bin_by_arrived(arrived_milli: np.ndarray, values: np.ndarray, total_gpus: int, decimals: int) -> list[Optional[float]]:
    """Mean of values whose arrived share rounds to each percent 0..130 (the authors' merge rule)."""
    arrived_pct = np.round(arrived_milli / total_gpus / 10)  # half to even, as pandas' round there
    rounded = np.array([round(float(v), 2) for v in values]) if decimals == 2 else values
    out: list[Optional[float]] = []
    for pct in range(ARRIVED_PCT_MAX + 1):
        chosen = rounded[arrived_pct == pct]
        if chosen.size == 0:
            chosen = rounded[(arrived_pct >= pct - 1) & (arrived_pct <= pct + 1)]
        out.append(round(float(chosen.mean()), 2) if chosen.size else None)
    return out


MixSource = Literal["trace", "online"]


def replay(
    nodes: Sequence[Node],
    pods: list[TracePod],
    policy_name: PolicyName,
    seed: int,
    tune: float = 1.3,
    trace: str = "",
    mix: MixSource = "trace",
    window: int = 1,
    defrag: bool = False,
    defrag_budget: float = DEFAULT_DEFRAG_BUDGET,
    move_cost_s: float = DEFAULT_MOVE_COST_S,
) -> ReplayResult:
    """Run the published procedure for one policy and seed; pure apart from the clock.

    `mix` is where FGD-style policies take the workload's typical pods from: "trace" is the whole
    pod list, as the simulator does; "online" learns them from the pods arrived so far
    (`OnlineMix`), as the portal's own cycle must. `window` > 1 is the batch mode: pods arriving
    within a window of that many are placed together (`batch.place_window`); the records of a
    window's pods are taken once it is placed. `defrag` makes room for a pod that fits nowhere by
    moving placed pods (module docstring), one pod at a time, so it needs a window of 1.
    """
    started = time.perf_counter()
    if seed < 0:
        raise ValueError(f"the seed must be 0 or more, got {seed}")
    if window < 1:
        raise ValueError(f"the window must be 1 or more pods, got {window}")
    if mix not in get_args(MixSource):
        raise ValueError(f"unknown mix {mix!r}; choose trace or online")
    check_defrag_settings(defrag_budget, move_cost_s)
    if defrag and window != 1:
        raise ValueError(f"defragmentation places one pod at a time; it needs a window of 1, got {window}")
    rng = np.random.default_rng(seed)
    state = replay_cluster(nodes)
    total_gpus = state.total_gpus
    workload = inflate(pods, total_gpus, tune, rng)
    state.tie_rank = rng.permutation(state.n_nodes)
    with_memory = policy_name == "portal"
    # FGD's typical pods come from the trace as given, before inflation, as in the simulator. The
    # fragmentation the replay reports is always measured against them, whatever the policy knows.
    trace_typical = typical_pods([pod.request for pod in pods], [pod.gpu_spec for pod in pods], with_memory=with_memory)
    online = OnlineMix([prior_pod(nodes)], with_memory) if mix == "online" else None
    policy = make_policy(policy_name, online.typical() if online else trace_typical)
    # The policy's own model serves the report when it holds the trace's mix and follows only this
    # state; a batch window moves it over scratch copies, so the report then keeps its own.
    shares_frag = isinstance(policy, FgdPolicy) and online is None and window == 1
    frag = policy.bind(state) if shares_frag else FragModel(state, trace_typical)
    frag_total = float(frag.frag_milli.sum())
    used_milli = state.allocated_gpu_milli()
    arrived = np.zeros(len(workload) + 1, dtype=np.int64)
    used = np.zeros(len(workload) + 1, dtype=np.int64)
    fragmented = np.zeros(len(workload) + 1, dtype=np.float64)
    used[0], fragmented[0] = used_milli, frag_total
    arrived_milli, placed = 0, 0
    # What defragmentation needs to know: every placed pod, by node, and how many pods hold each GPU.
    placements = Placements(state)
    moves, placed_by_moves, moved_milli = 0, 0, 0
    for first in range(0, len(workload), window):
        arriving = workload[first:first + window]
        batch = [trace_pod.request for trace_pod in arriving]
        if online is not None:
            for trace_pod in arriving:
                online.see(trace_pod.request, trace_pod.gpu_spec)
            # The pods of this window have arrived, so their shapes are known before they are placed.
            if online.due() and isinstance(policy, FgdPolicy):
                policy.retarget(online.typical())
        touched = []
        if window == 1:
            pod = batch[0]
            feasible = state.feasible(pod)
            choices = [policy.select(state, pod, feasible, rng) if feasible.size else None]
            if choices[0] is not None:
                state.place(choices[0].row, pod, choices[0].gpus)
                if defrag:
                    placements.add(Running(first, pod, choices[0].row, tuple(choices[0].gpus)))
            elif defrag:
                allowed = moves_allowed(defrag_budget, first + 1, moves)
                plan = plan_room(state, pod, placements, max_moves=allowed) if allowed else None
                if plan is not None:
                    apply_plan(state, pod, plan, placements, key=first)
                    touched += [row for move in plan.moves for row in (move.running.row, move.to_row)]
                    moves += len(plan.moves)
                    placed_by_moves += 1
                    moved_milli += plan.moved_gpu_milli
                    choices = [Choice(plan.row, plan.gpus)]
        else:
            choices = place_window(state, batch, policy, rng)
        for pod, choice in zip(batch, choices):
            if choice is not None:
                placed += 1
                used_milli += pod.gpu_milli * len(choice.gpus)
                touched.append(choice.row)
        if touched:
            rows = np.unique(np.array(touched))
            before = frag.frag_milli[rows].sum()
            frag.refresh(rows)
            frag_total += frag.frag_milli[rows].sum() - before
        for offset, pod in enumerate(batch):
            arrived_milli += pod.total_gpu_milli
            step = first + offset + 1
            arrived[step], used[step], fragmented[step] = arrived_milli, used_milli, frag_total
    elapsed = time.perf_counter() - started
    return ReplayResult(
        policy=policy_name,
        trace=trace,
        seed=seed,
        total_gpus=total_gpus,
        pods_arrived=len(workload),
        pods_placed=placed,
        pods_failed=len(workload) - placed,
        allocation_pct_by_arrived=bin_by_arrived(arrived, used / total_gpus / 10, total_gpus, 2),
        fragmentation_pct_by_arrived=bin_by_arrived(arrived, 100 * fragmented / 1000 / total_gpus, total_gpus, 0),
        elapsed_s=round(elapsed, 3),
        pods_per_s=round(len(workload) / elapsed, 1) if elapsed > 0 else 0.0,
        mix=mix,
        window=window,
        defrag=defrag,
        defrag_budget=defrag_budget if defrag else 0.0,
        moves=moves,
        moves_per_1000_pods=round(1000 * moves / len(workload), 2) if workload else 0.0,
        pods_placed_by_moves=placed_by_moves,
        gpu_seconds_lost_to_moves=round(moved_milli / 1000 * move_cost_s, 1),
    )


def trace_name(pods_path: str) -> str:
    """'default' for openb_pod_list_default.csv; the file stem otherwise."""
    stem = Path(pods_path).stem
    return stem.removeprefix("openb_pod_list_")


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"replay: error: {message}\n")


def main(argv: Optional[list[str]] = None) -> int:
    """Command-line entry point; bad input exits 2 with one line on stderr."""
    parser = _OneLineParser(prog="python -m runners.scheduler.replay", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", required=True, help="node list CSV (sn,cpu_milli,memory_mib,gpu,model)")
    parser.add_argument("--pods", required=True, help="pod list CSV (name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec])")
    parser.add_argument("--policy", required=True, help=f"one of {', '.join(POLICY_NAMES)}")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--tune", type=float, default=1.3, help="inflate to this many times the cluster's GPUs (<= 0: as is)")
    parser.add_argument("--mix", default="trace", help="typical pods from the whole 'trace' (as published) or 'online'")
    parser.add_argument("--window", type=int, default=1, help="place the pods arriving within this many together")
    parser.add_argument("--defrag", action="store_true", help="make room for a pod that fits nowhere by moving placed pods")
    parser.add_argument("--defrag-budget", type=float, default=None, metavar="SHARE",
                        help=f"moves allowed per pod arrived (default {DEFAULT_DEFRAG_BUDGET:g}); needs --defrag")
    parser.add_argument("--move-cost-s", type=float, default=None, metavar="S",
                        help=f"seconds of its GPUs a move costs (default {DEFAULT_MOVE_COST_S:g}); needs --defrag")
    parser.add_argument("--departures", action="store_true",
                        help="replay in time: pods arrive at creation_time, run until deletion_time, queue when they do not fit")
    parser.add_argument("--arrive-within", type=float, default=None, metavar="SECONDS",
                        help="with --departures: compress the arrival times into this many seconds (default: as they are)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.arrive_within is not None and not args.departures:
        parser.error("--arrive-within needs --departures")
    if args.departures and (args.window != 1 or args.mix != "trace"):
        parser.error("--departures places one pod at a time with the trace's mix; leave out --window and --mix")
    if not args.defrag and (args.defrag_budget is not None or args.move_cost_s is not None):
        parser.error("--defrag-budget and --move-cost-s need --defrag")
    budget = DEFAULT_DEFRAG_BUDGET if args.defrag_budget is None else args.defrag_budget
    move_cost_s = DEFAULT_MOVE_COST_S if args.move_cost_s is None else args.move_cost_s
    if args.policy not in POLICY_NAMES:
        parser.error(f"unknown policy {args.policy!r}; choose one of {', '.join(POLICY_NAMES)}")
    if args.seed < 0:
        parser.error(f"--seed must be 0 or more, got {args.seed}")
    try:
        nodes = load_nodes(args.nodes)
        pods = load_pods(args.pods)
        if args.departures:
            timed = departures_replay(nodes, pods, args.policy, args.seed, arrive_within=args.arrive_within, tune=max(args.tune, 0.0),
                                      trace=trace_name(args.pods), defrag=args.defrag, defrag_budget=budget,
                                      move_cost_s=move_cost_s)
        else:
            result = replay(nodes, pods, args.policy, args.seed, args.tune, trace_name(args.pods), args.mix, args.window,
                            defrag=args.defrag, defrag_budget=budget, move_cost_s=move_cost_s)
    except ValueError as error:  # TraceError is one too
        parser.error(str(error))
    if args.departures:
        if args.json:
            print(json.dumps(timed.as_dict()))
        else:
            print(
                f"{timed.policy} on {timed.trace} (seed {timed.seed}, in time): {timed.pods_started}/{timed.pods} pods started, "
                f"waits mean {timed.wait_mean_s:g} s and p99 {timed.wait_p99_s:g} s, "
                f"{timed.allocation_mean_pct:g}% of {timed.total_gpus} GPUs allocated on average, "
                f"{timed.gpu_hours_delivered_pct:g}% of the GPU-hours delivered while arriving"
                + (f"; {timed.moves} moves ({timed.gpu_seconds_lost_to_moves:g} GPU-s lost to them)" if timed.defrag else "")
            )
        return 0
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        at_130 = result.allocation_pct_by_arrived[ARRIVED_PCT_MAX]
        print(
            f"{result.policy} on {result.trace} (seed {result.seed}): {result.pods_placed}/{result.pods_arrived} pods placed, "
            f"{at_130}% of {result.total_gpus} GPUs allocated at {ARRIVED_PCT_MAX}% arrived, "
            f"{result.pods_per_s:.0f} pods/s"
            + (f"; {result.moves} moves ({result.moves_per_1000_pods:g} per 1,000 pods, "
               f"{result.gpu_seconds_lost_to_moves:g} GPU-s lost to them)" if result.defrag else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
