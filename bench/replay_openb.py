"""Benchmark: replay the openb traces with every policy and compare with the published results.

Prints, per trace and policy, the mean GPU allocation at 130% arrived over the seeds beside the
authors' published mean (openb/published_allocation_at_130.csv), the worst seed, and replay
speed; `--scaling` replays `portal` on the cluster replicated 4x and 16x (pods replicated alike)
and prints pods/s and microseconds per pod; `--plot` draws allocation against arrived workload
for portal, fgd and bestfit on `default`, beside the authors' curves.

Every replay appends one JSON line to --results, so the bench can be run in parts and the table
and plot rebuilt from what is there (`--report-only`).

The trace files come from $OPENB_DIR, by default tests/data/openb: the part of the trace the
repository ships (node list, the five tuning traces, multigpu50 and the published means; see its
README). Other traces and --plot need OPENB_DIR set to the full openb folder
(OPENB_DIR=../shared/traces/openb on this project's machines).

    python bench/replay_openb.py --traces default,cpu050 --seeds 42-51 --policies fgd,portal --jobs 2
    python bench/replay_openb.py --scaling 1,4,16
    python bench/replay_openb.py --scaling 1 --scaling-seeds 100-105 --policies fgd,portal --jobs 1
    python bench/replay_openb.py --report-only --plot bench/openb_default_allocation.png
    python bench/replay_openb.py --traces all --policies portal --variants online:1,online:8,online:64,online:512
    python bench/replay_openb.py --report-only --plot-traces bench/openb_traces_idle.png

Never run as a test: a full run takes tens of minutes on two cores.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runners.scheduler.model import Node  # noqa: E402
from runners.scheduler.openb import TracePod, load_nodes, load_pods  # noqa: E402
from runners.scheduler.policies import POLICY_NAMES  # noqa: E402
from runners.scheduler.replay import replay  # noqa: E402

# The shipped subset of openb (tests/data/openb/README.md) unless OPENB_DIR names a full copy.
OPENB = Path(os.environ.get("OPENB_DIR") or REPO / "tests" / "data" / "openb")
NODE_LIST = "openb_node_list_gpu_node.csv"
TUNING_TRACES = ("default", "cpu050", "gpushare40", "gpuspec10", "multigpu20")
ALL_TRACES = (
    "default", "cpu050", "cpu100", "cpu200", "cpu250", "gpushare40", "gpushare60", "gpushare80", "gpushare100",
    "gpuspec10", "gpuspec20", "gpuspec25", "gpuspec33", "multigpu20", "multigpu30", "multigpu40", "multigpu50",
)
PUBLISHED_COLUMN = {
    "random": "Random", "dotprod": "DotProd", "clustering": "GpuClustering", "packing": "GpuPacking",
    "bestfit": "BestFit", "fgd": "FGD",
}
EXPECTED_POLICY = {"random": "01-Random", "dotprod": "02-DotProd", "clustering": "03-GpuClustering",
                   "packing": "04-GpuPacking", "bestfit": "05-BestFit", "fgd": "06-FGD"}


def parse_seeds(text: str) -> list[int]:
    """'42-51' or '42,43' -> list of seeds."""
    seeds = []
    for part in text.split(","):
        if "-" in part:
            low, high = part.split("-")
            seeds.extend(range(int(low), int(high) + 1))
        elif part:
            seeds.append(int(part))
    return seeds


def replicate(nodes: list[Node], pods: list[TracePod], times: int) -> tuple[list[Node], list[TracePod]]:
    """The cluster and its pods copied `times` times, names made unique."""
    if times == 1:
        return nodes, pods
    big_nodes = [replace(node, name=f"{node.name}-x{k}", gpus=list(node.gpus)) for k in range(times) for node in nodes]
    big_pods = [
        TracePod(replace(pod.request, name=f"{pod.request.name}-x{k}"), pod.gpu_spec) for k in range(times) for pod in pods
    ]
    return big_nodes, big_pods


def run_one(job: tuple) -> dict:
    """One replay (in a worker process); returns its result with the job's labels."""
    trace, policy, seed, times, mix, window = job
    nodes, pods = replicate(load_nodes(OPENB / NODE_LIST), load_pods(OPENB / f"openb_pod_list_{trace}.csv"), times)
    result = replay(nodes, pods, policy, seed, trace=trace, mix=mix, window=window).as_dict()
    result["times"] = times
    result["n_nodes"] = len(nodes)
    return result


def first_missing(paths: list[Path]) -> Path | None:
    """The first of the trace files that is not there, or None."""
    return next((path for path in paths if not path.is_file()), None)


def load_results(path: Path) -> list[dict]:
    """Every replay recorded so far."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def published() -> dict[str, dict[str, float]]:
    """trace -> policy column -> published mean allocation at 130%."""
    with open(OPENB / "published_allocation_at_130.csv") as handle:
        return {row["trace"]: row for row in csv.DictReader(handle)}


def report(results: list[dict]) -> str:
    """Markdown tables: allocation vs published per trace and policy, then scaling."""
    table = published()
    lines = ["| trace | policy | seeds | mean alloc @130% | published | diff | worst seed | FGD-relative unallocated | pods/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str, str, int], list[dict]] = {}
    for result in results:
        if result.get("times", 1) == 1:
            key = (result["trace"], result["policy"], result.get("mix", "trace"), result.get("window", 1))
            groups.setdefault(key, []).append(result)
    order = {name: i for i, name in enumerate(ALL_TRACES)}
    policy_order = {name: i for i, name in enumerate(POLICY_NAMES)}
    for (trace, policy, mix, window), runs in sorted(
        groups.items(), key=lambda item: (order.get(item[0][0], 99), policy_order[item[0][1]], item[0][2] != "trace", item[0][3])
    ):
        by_seed = {run["seed"]: run for run in runs}
        values = np.array([run["allocation_pct_by_arrived"][130] for run in by_seed.values()])
        speed = np.mean([run["pods_per_s"] for run in by_seed.values()])
        column = PUBLISHED_COLUMN.get(policy, "FGD")
        reference = float(table[trace][column]) if trace in table else float("nan")
        fgd_unallocated = 100 - float(table[trace]["FGD"]) if trace in table else float("nan")
        relative = (100 - values.mean()) / fgd_unallocated if policy in ("portal", "fgd") else float("nan")
        label = f"FGD {reference:.2f}" if policy == "portal" or (mix, window) != ("trace", 1) else f"{reference:.2f}"
        name = policy_label(policy, mix, window)
        lines.append(
            f"| {trace} | {name} | {len(values)} | {values.mean():.2f} | {label} | "
            f"{values.mean() - reference:+.2f} | {values.min():.2f} | "
            f"{'' if np.isnan(relative) else f'{relative:.3f}'} | {speed:,.0f} |"
        )
    lines += ["", *modes_table(groups, table)]
    scaling = [r for r in results if r.get("times", 1) != 1 or r.get("scaling")]
    if scaling:
        lines += ["", "| cluster | nodes | pods | policy | alloc @130% | elapsed s | pods/s | us/pod |", "|---|---|---|---|---|---|---|---|"]
        for run in sorted(scaling, key=lambda r: r["times"]):
            lines.append(
                f"| {run['times']}x | {run['n_nodes']:,} | {run['pods_arrived']:,} | {run['policy']} | "
                f"{run['allocation_pct_by_arrived'][130]:.2f} | {run['elapsed_s']:.1f} | {run['pods_per_s']:,.0f} | "
                f"{1e6 / run['pods_per_s']:.0f} |"
            )
        speeds: dict[tuple[int, str], list[float]] = {}
        for run in scaling:
            speeds.setdefault((run["times"], run["policy"]), []).append(run["pods_per_s"])
        lines += ["", "| cluster | policy | replays | mean pods/s |", "|---|---|---|---|"]
        for (times, policy), values in sorted(speeds.items()):
            lines.append(f"| {times}x | {policy} | {len(values)} | {np.mean(values):,.0f} |")
    return "\n".join(lines)


def modes_table(groups: dict[tuple[str, str, str, int], list[dict]], table: dict) -> list[str]:
    """One row per trace: idle GPUs at 130% over the published FGD's, a column per policy and mode."""
    modes = sorted(
        {key[1:] for key in groups if key[1] in ("fgd", "portal")}, key=lambda mode: (mode[0] != "fgd", mode[1] != "trace", mode[2])
    )
    if len(modes) < 2:
        return []
    header = ["trace", "published FGD", *(policy_label(*mode) for mode in modes)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for trace in ALL_TRACES:
        if trace not in table or not any((trace, *mode) in groups for mode in modes):
            continue
        cells = [trace, table[trace]["FGD"]]
        for mode in modes:
            runs = groups.get((trace, *mode))
            if not runs:
                cells.append("")
                continue
            mean = np.mean([run["allocation_pct_by_arrived"][130] for run in runs])
            cells.append(f"{mean:.2f} ({(100 - mean) / (100 - float(table[trace]['FGD'])):.3f})")
        lines.append("| " + " | ".join(cells) + " |")
    return ["Mean allocation at 130% (idle GPUs over the published FGD's):", "", *lines]


def policy_label(policy: str, mix: str, window: int) -> str:
    """'portal', 'portal (online mix)', 'portal (online mix, window 64)'."""
    extras = ([] if mix == "trace" else [f"{mix} mix"]) + ([] if window == 1 else [f"window {window}"])
    return f"{policy} ({', '.join(extras)})" if extras else policy


def variant(text: str) -> tuple[str, int]:
    """'online:64' -> ('online', 64)."""
    mix, _, window = text.partition(":")
    return mix, int(window or 1)


def plot(results: list[dict], path: Path) -> None:
    """Allocation against arrived workload on `default`: ours for portal, fgd, bestfit; the authors' dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    expected: dict[str, list[list[float]]] = {}
    with open(OPENB / "expected_results" / "analysis_allo_discrete.csv") as handle:
        for row in csv.DictReader(handle):
            if row["workload"] == "openb_pod_list_default":
                expected.setdefault(row["sc_policy"], []).append([float(row[str(i)]) if row[str(i)] else np.nan for i in range(131)])
    figure, (whole, zoom) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = {"portal": "tab:green", "fgd": "tab:blue", "bestfit": "tab:orange"}
    x = np.arange(131)
    for policy, colour in colours.items():
        runs = [r for r in results if r["trace"] == "default" and r["policy"] == policy and r.get("times", 1) == 1
                and r.get("mix", "trace") == "trace" and r.get("window", 1) == 1]
        if runs:
            curve = np.nanmean([[np.nan if v is None else v for v in r["allocation_pct_by_arrived"]] for r in runs], axis=0)
            for axis in (whole, zoom):
                axis.plot(x, curve, color=colour, label=f"{policy} (ours, {len(runs)} seeds)")
        if policy in EXPECTED_POLICY and EXPECTED_POLICY[policy] in expected:
            curve = np.nanmean(expected[EXPECTED_POLICY[policy]], axis=0)
            for axis in (whole, zoom):
                axis.plot(x, curve, color=colour, linestyle="--", label=f"{policy} (published)")
    whole.plot(x, np.minimum(x, 100), color="grey", linewidth=0.5, label="arrived")
    for axis in (whole, zoom):
        axis.set_xlabel("arrived workload (% of cluster GPUs)")
        axis.set_ylabel("GPUs allocated (%)")
        axis.grid(alpha=0.3)
    zoom.set_xlim(80, 130)
    zoom.set_ylim(85, 97)
    whole.set_title("openb default, 1,213 nodes / 6,212 GPUs")
    zoom.set_title("zoom: 80-130% arrived")
    zoom.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def plot_traces(results: list[dict], path: Path) -> None:
    """Per trace: idle GPUs at 130% against the published FGD's, for every policy and mode replayed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = published()
    groups: dict[tuple, dict[str, list[float]]] = {}
    for result in results:
        if result.get("times", 1) != 1 or result["policy"] not in ("fgd", "portal") or result["trace"] not in table:
            continue
        mix, window = result.get("mix", "trace"), result.get("window", 1)
        key = (result["policy"] != "fgd", mix != "trace", window, policy_label(result["policy"], mix, window))
        groups.setdefault(key, {}).setdefault(result["trace"], []).append(result["allocation_pct_by_arrived"][130])
    traces = [trace for trace in ALL_TRACES if any(trace in runs for runs in groups.values())]
    figure, axis = plt.subplots(figsize=(13, 4.8))
    width = 0.8 / max(len(groups), 1)
    for index, ((*_, label), runs) in enumerate(sorted(groups.items())):
        ratios = [
            (100 - np.mean(runs[trace])) / (100 - float(table[trace]["FGD"])) if trace in runs else np.nan for trace in traces
        ]
        axis.bar(np.arange(len(traces)) + (index - (len(groups) - 1) / 2) * width, ratios, width, label=label)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.axhline(0.9, color="grey", linestyle="--", linewidth=0.8, label="10% fewer idle GPUs than FGD")
    axis.set_xticks(np.arange(len(traces)), traces, rotation=45, ha="right")
    axis.set_ylabel("idle GPUs at 130%, / published FGD's")
    axis.set_ylim(0.6, 1.2)
    axis.legend(fontsize=7, ncol=3, loc="upper left")
    axis.grid(axis="y", alpha=0.3)
    axis.set_title("openb, 17 traces, mean of the seeds replayed: lower is better")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=",".join(TUNING_TRACES), help="comma-separated, or 'tuning' / 'all'")
    parser.add_argument("--seeds", default="42-51")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument(
        "--variants", default="trace:1",
        help="mix:window pairs replayed for portal and fgd, e.g. trace:1,online:1,online:8,online:64,online:512",
    )
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (at most 2 on the shared machine)")
    parser.add_argument("--scaling", default="", help="replicate the cluster this many times for portal, e.g. 1,4,16")
    parser.add_argument("--scaling-seeds", default="42", help="seeds for --scaling, e.g. 100-105")
    parser.add_argument("--results", type=Path, default=Path("/tmp/replay_openb_results.jsonl"))
    parser.add_argument("--report-only", action="store_true", help="only print the tables from --results")
    parser.add_argument("--plot", type=Path, default=None, help="write the default-trace plot (PNG) here")
    parser.add_argument("--plot-traces", type=Path, default=None, help="write the per-trace idle-GPU ratio plot (PNG) here")
    args = parser.parse_args()
    jobs = min(max(args.jobs, 1), 2)
    traces = {"tuning": TUNING_TRACES, "all": ALL_TRACES}.get(args.traces, tuple(t for t in args.traces.split(",") if t))
    work = []
    if not args.report_only:
        done = {
            (r["trace"], r["policy"], r["seed"], r.get("times", 1), r.get("mix", "trace"), r.get("window", 1))
            for r in load_results(args.results)
        }
        variants = [variant(text) for text in args.variants.split(",") if text]
        if args.scaling:
            # Policies alternate seed by seed (fgd, portal, then portal, fgd, ...), so that with
            # --jobs 1 a drift of the machine's speed falls on both alike.
            policies = args.policies.split(",")
            work = [
                ("default", p, seed, int(times), "trace", 1)
                for times in args.scaling.split(",")
                for index, seed in enumerate(parse_seeds(args.scaling_seeds))
                for p in (policies if index % 2 == 0 else policies[::-1])
            ]
        else:
            work = [
                (t, p, s, 1, mix, window)
                for t in traces for p in args.policies.split(",") for s in parse_seeds(args.seeds)
                for mix, window in (variants if p in ("fgd", "portal") else [("trace", 1)])
            ]
        work = [job for job in work if job not in done]
    needed = [OPENB / "published_allocation_at_130.csv"]
    if work:
        needed += [OPENB / NODE_LIST] + [OPENB / f"openb_pod_list_{trace}.csv" for trace in dict.fromkeys(job[0] for job in work)]
    if args.plot:
        needed.append(OPENB / "expected_results" / "analysis_allo_discrete.csv")
    missing = first_missing(needed)
    if missing is not None:
        print(
            f"replay_openb: {missing} does not exist (the repository ships only part of openb); "
            "set OPENB_DIR to the full openb folder, e.g. OPENB_DIR=../shared/traces/openb",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    if work:
        with ProcessPoolExecutor(max_workers=jobs) as pool, open(args.results, "a") as out:
            for result in pool.map(run_one, work):
                if args.scaling:
                    result["scaling"] = True
                out.write(json.dumps(result) + "\n")
                out.flush()
                print(
                    f"{result['trace']:12s} {policy_label(result['policy'], result['mix'], result['window']):28s} seed {result['seed']} x{result['times']}: "
                    f"{result['allocation_pct_by_arrived'][130]:.2f}% at 130%, {result['pods_per_s']:,.0f} pods/s",
                    flush=True,
                )
        print(f"{len(work)} replays in {time.perf_counter() - started:.0f} s", flush=True)
    results = load_results(args.results)
    print(report(results))
    if args.plot:
        plot(results, args.plot)
        print(f"plot written to {args.plot}")
    if args.plot_traces:
        plot_traces(results, args.plot_traces)
        print(f"plot written to {args.plot_traces}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
