"""Benchmark: defragmentation by migration on the openb traces, in both replays.

Two parts, each a table of `fgd`, `portal` and `portal --defrag` per trace (means over the seeds):

* `--part arrived`: the 130 %-arrived replay (`runners/scheduler/replay.py`): GPUs left unallocated at
  130 % arrived, their ratio to our FGD's, and the moves per 100 pods.
* `--part departures`: the replay in time (`runners/scheduler/departures.py`), inflated to `--tune`
  (1.3) and arriving within `--arrive-within` seconds: mean and p99 queueing delay, mean allocation
  while work waited, GPU-hours delivered while arriving, moves per 1,000 pods and GPU-seconds lost to
  them. Only the 13 lists with creation and deletion times (the four multigpu lists have none).

Every replay appends one JSON line to --results; `--report-only` rebuilds the tables from it, and
`--plot FILE` draws the departures part's p99 delays per trace.

    export OPENB_DIR=../shared/traces/openb
    python bench/defrag_openb.py --part arrived --seeds 42-44 --jobs 2
    python bench/defrag_openb.py --part departures --seeds 42-44 --arrive-within 60 --jobs 2
    python bench/defrag_openb.py --report-only --plot bench/defrag_departures.png

Never run as a test: all traces take about ten minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runners.scheduler.departures import departures_replay  # noqa: E402
from runners.scheduler.openb import load_nodes, load_pods  # noqa: E402
from runners.scheduler.replay import ARRIVED_PCT_MAX, replay  # noqa: E402

OPENB = Path(os.environ.get("OPENB_DIR") or REPO / "tests" / "data" / "openb")
TIMED = ("default", "cpu050", "cpu100", "cpu200", "cpu250", "gpushare40", "gpushare60", "gpushare80", "gpushare100",
         "gpuspec10", "gpuspec20", "gpuspec25", "gpuspec33")
ALL = TIMED + ("multigpu20", "multigpu30", "multigpu40", "multigpu50")
SYSTEMS = (("fgd", False), ("portal", False), ("portal", True))


def _one(job: tuple) -> dict:
    part, trace, seed, policy, defrag, arrive_within, tune = job
    nodes = load_nodes(OPENB / "openb_node_list_gpu_node.csv")
    pods = load_pods(OPENB / f"openb_pod_list_{trace}.csv")
    if part == "arrived":
        result = replay(nodes, pods, policy, seed, tune=tune, trace=trace, defrag=defrag).as_dict()
        result["unallocated_gpus"] = round(result["total_gpus"] * (100 - result["allocation_pct_by_arrived"][ARRIVED_PCT_MAX]) / 100, 1)
        for key in ("allocation_pct_by_arrived", "fragmentation_pct_by_arrived"):
            result.pop(key)
    else:
        result = departures_replay(nodes, pods, policy, seed, arrive_within=arrive_within, tune=tune, trace=trace,
                                   defrag=defrag).as_dict()
        result.pop("allocation_series")
    result["part"] = part
    return result


def _system(row: dict) -> str:
    return row["policy"] + (" --defrag" if row["defrag"] else "")


def report(rows: list[dict]) -> None:
    for part in ("arrived", "departures"):
        chosen = [row for row in rows if row["part"] == part]
        if not chosen:
            continue
        traces = [trace for trace in ALL if any(row["trace"] == trace for row in chosen)]
        if part == "arrived":
            print("| trace | system | seeds | unallocated GPUs at 130% | vs our fgd | moves per 100 pods |")
            print("|---|---|---|---|---|---|")
        else:
            print("| trace | system | seeds | wait mean s | wait p99 s | p99 vs fgd | allocation while busy % "
                  "| GPU-hours delivered while arriving % | moves per 1,000 pods | GPU-s lost to moves |")
            print("|---|---|---|---|---|---|---|---|---|---|")
        for trace in traces:
            base = None
            for policy, defrag in SYSTEMS:
                name = policy + (" --defrag" if defrag else "")
                mine = [row for row in chosen if row["trace"] == trace and _system(row) == name]
                if not mine:
                    continue
                mean = lambda key: float(np.mean([row[key] for row in mine]))  # noqa: E731
                if part == "arrived":
                    idle = mean("unallocated_gpus")
                    base = idle if policy == "fgd" else base
                    moves = 100 * sum(row["moves"] for row in mine) / sum(row["pods_arrived"] for row in mine)
                    ratio = f"{idle / base:.3f}" if base else ""
                    print(f"| {trace} | {name} | {len(mine)} | {idle:.1f} | {ratio} | {moves:.2f} |")
                else:
                    p99 = mean("wait_p99_s")
                    base = p99 if policy == "fgd" else base
                    ratio = f"{p99 / base:.3f}" if base else ""
                    print(f"| {trace} | {name} | {len(mine)} | {mean('wait_mean_s'):.1f} | {p99:.1f} | {ratio} "
                          f"| {mean('allocation_mean_pct'):.2f} | {mean('gpu_hours_delivered_pct'):.2f} "
                          f"| {mean('moves_per_1000_pods'):.2f} | {mean('gpu_seconds_lost_to_moves'):.0f} |")
        print()


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [row for row in rows if row["part"] == "departures"]
    traces = [trace for trace in TIMED if any(row["trace"] == trace for row in chosen)]
    figure, axes = plt.subplots(figsize=(11, 4))
    width = 0.27
    for offset, (policy, defrag) in enumerate(SYSTEMS):
        name = policy + (" --defrag" if defrag else "")
        values = [np.mean([row["wait_p99_s"] for row in chosen if row["trace"] == trace and _system(row) == name] or [np.nan])
                  for trace in traces]
        axes.bar(np.arange(len(traces)) + (offset - 1) * width, values, width, label=name)
    axes.set_xticks(np.arange(len(traces)), traces, rotation=30, ha="right")
    axes.set_ylabel("p99 queueing delay, s")
    axes.set_title("openb in time: inflated to 1.3x, arrivals within a minute, departures at their durations")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _seeds(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("arrived", "departures"))
    parser.add_argument("--traces", default="all", help="comma-separated, or 'all'")
    parser.add_argument("--seeds", default="42-44")
    parser.add_argument("--arrive-within", type=float, default=60.0)
    parser.add_argument("--tune", type=float, default=1.3)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--results", default="/tmp/defrag_openb.jsonl")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--plot")
    args = parser.parse_args()
    if not args.report_only:
        if args.part is None:
            parser.error("--part is needed unless --report-only")
        traces = (TIMED if args.part == "departures" else ALL) if args.traces == "all" else tuple(args.traces.split(","))
        missing = [t for t in traces if not (OPENB / f"openb_pod_list_{t}.csv").exists()]
        if missing:
            parser.exit(2, f"defrag_openb: error: {OPENB} has no pod list for {missing[0]}; set OPENB_DIR to the full openb folder\n")
        jobs = [(args.part, trace, seed, policy, defrag, args.arrive_within, args.tune)
                for trace in traces for seed in _seeds(args.seeds) for policy, defrag in SYSTEMS]
        with ProcessPoolExecutor(args.jobs) as pool, open(args.results, "a") as out:
            for result in pool.map(_one, jobs):
                out.write(json.dumps(result) + "\n")
                out.flush()
    rows = [json.loads(line) for line in open(args.results)]
    report(rows)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
