"""Benchmark: cache-aware placement against cache-blind, on a stream of jobs reading datasets.

M datasets of N shards; a stream of jobs, each reading one dataset (a Zipf law: a few datasets
popular, most read now and then), arriving as a Poisson stream that offers `--load` times the
cluster's GPUs, running an exponential time and leaving. Every node has a shard cache of
`--cache-gib` (least recently used out, never a shard a running job reads) filled before a job's
ranks start; what it lacks is pulled from storage at `--bandwidth-gib-s` per node. The same stream
is replayed twice per seed with the portal's placement policy, once giving placement each job's
cached bytes per node and once not (`runners.scheduler.cache_replay` describes the model), and the
bench prints, per cluster, bytes pulled from storage, the cache's hit rate, time to first step
(queue wait plus the slowest node's pull) and the GPU allocation averaged over the stream.

Two clusters:

* demo: the demo cluster's H100 nodes (whole GPUs) and time-sliced T4 nodes (runners/clusters/demo.yaml;
  the MIG-partitioned A100 is left out: the replay gives GPUs back through ClusterState.release,
  which takes no MIG slices). Jobs: 1 or 2 replicas of 1, 2, 4 or 8 H100s, preferring one node,
  and single T4 replicas of a quarter GPU.
* openb: the openb node list (1,213 nodes, 6,212 GPUs, tests/data/openb/); jobs: pods drawn from
  the `default` trace's GPU pods, each a job of one replica.

    python bench/cache_placement.py                          # both clusters, seeds 1-3, about 4 minutes
    python bench/cache_placement.py --clusters demo --seeds 1 --jobs-demo 300   # the suite's short form
    python bench/cache_placement.py --json /tmp/cache_placement.jsonl           # one JSON line per replay

Never run as a test (the suite runs the short form in tests/scheduler/test_cache_replay.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.replay_openb import parse_seeds  # noqa: E402
from runners.backends.cluster_file import load_cluster_file  # noqa: E402
from runners.scheduler.cache_replay import replay_stream, synthetic_datasets, synthetic_stream  # noqa: E402
from runners.scheduler.model import GPU_MILLI, Gpu, Node, PodRequest  # noqa: E402
from runners.scheduler.openb import load_nodes, load_pods  # noqa: E402

GIB = 1024**3
MIB = 1024**2
OPENB = Path(os.environ.get("OPENB_DIR") or REPO / "tests" / "data" / "openb")
DEMO_CLUSTER = REPO / "runners" / "clusters" / "demo.yaml"


def demo_nodes(path: Path = DEMO_CLUSTER) -> list[Node]:
    """The demo cluster's whole-GPU and time-sliced nodes as placement sees them (MIG GPUs left out)."""
    nodes = []
    for info in load_cluster_file(path):
        gpus = [gpu for gpu in info.gpus if gpu.partition_kind != "mig"]
        if info.gpus and not gpus:
            continue
        nodes.append(Node(
            name=info.name, cpu_milli=info.cpu_milli, memory_mib=info.memory_mib,
            gpus=[Gpu(gpu.model, gpu.memory_mib, nvlink_domain=info.nvlink_domain or None) for gpu in gpus],
            rack=info.rack or None, block=info.block or None,
        ))
    return nodes


def demo_shapes(nodes: list[Node]) -> list:
    """The demo stream's job shapes: H100 gangs (1-2 replicas of 1, 2 or 4 GPUs, preferring one node, or
    one of 8) and single T4 quarters, weighted so that each model's GPUs are offered the same load."""
    h100 = [((PodRequest("h100", 16000 * gpus, 131072 * gpus, gpus, GPU_MILLI, frozenset({"H100-80GB"})),) * replicas,
             "node", False) for replicas in (1, 2) for gpus in (1, 2, 4)]
    h100.append(((PodRequest("h100", 128000, 1048576, 8, GPU_MILLI, frozenset({"H100-80GB"})),), "none", False))
    t4 = [((PodRequest("t4", 4000, 16384, 1, GPU_MILLI // 4, frozenset({"T4"})),), "none", False)]
    gpus_of = {model: sum(len(node.gpus) for node in nodes if node.gpu_model == model) for model in ("H100-80GB", "T4")}
    shapes = []
    for model, group in (("H100-80GB", h100), ("T4", t4)):
        # Each shape's weight makes its model's GPU demand proportional to the model's GPUs.
        mean_gpus = sum(sum(pod.total_gpu_milli for pod in pods) for pods, _, _ in group) / len(group) / GPU_MILLI
        shapes += [(pods, topology, required, gpus_of[model] / mean_gpus / len(group)) for pods, topology, required in group]
    return shapes


def openb_shapes(trace: str = "default") -> list:
    """Every GPU pod of an openb trace as a one-replica job shape (drawn uniformly: the trace's mix)."""
    pods = load_pods(OPENB / f"openb_pod_list_{trace}.csv")
    return [((pod.request,), "none", False, 1.0) for pod in pods if pod.request.gpu_count]


def run(cluster: str, seed: int, args: argparse.Namespace) -> list[dict]:
    """Both replays (cache-blind, cache-aware) of one cluster's stream for one seed; their summaries."""
    if cluster == "demo":
        nodes, shapes, jobs = demo_nodes(), None, args.jobs_demo
        shapes = demo_shapes(nodes)
    else:
        nodes, shapes, jobs = load_nodes(OPENB / "openb_node_list_gpu_node.csv"), openb_shapes(), args.jobs_openb
    datasets = synthetic_datasets(args.datasets, args.shards, int(args.shard_mib * MIB))
    total_gpus = sum(len(node.gpus) for node in nodes)
    stream = synthetic_stream(shapes, jobs=jobs, datasets=len(datasets), total_gpus=total_gpus, load=args.load,
                              mean_runtime_s=args.runtime_min * 60, zipf_s=args.zipf, seed=seed)
    rows = []
    for aware in (False, True):
        result = replay_stream(
            nodes, datasets, stream, cache_aware=aware, cache_bytes_per_node=int(args.cache_gib * GIB),
            bandwidth_bytes_per_s=args.bandwidth_gib_s * GIB, seed=seed, pass_limit=args.pass_limit,
            cache_tolerance_points=args.tolerance,
        )
        rows.append({"cluster": cluster, "nodes": len(nodes), **result.summary()})
    return rows


def _mean(rows: list[dict], key: str) -> float:
    return sum(row[key] for row in rows) / len(rows)


def report(rows: list[dict]) -> str:
    """One markdown table: per cluster and placement, the means over seeds; then the differences."""
    lines = [
        "| cluster | placement | seeds | jobs placed | pulled from storage (TiB) | cache hits | "
        "time to first step, mean s (p50 / p90) | jobs pulling nothing | wait in queue, mean s | GPU allocation % |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for cluster in dict.fromkeys(row["cluster"] for row in rows):
        by_mode = {aware: [row for row in rows if row["cluster"] == cluster and row["cache_aware"] == aware]
                   for aware in (False, True)}
        for aware, chosen in by_mode.items():
            if not chosen:
                continue
            lines.append(
                f"| {cluster} | {'cache-aware' if aware else 'cache-blind'} | {len(chosen)} | "
                f"{_mean(chosen, 'jobs_placed'):,.0f} / {_mean(chosen, 'jobs'):,.0f} | "
                f"{_mean(chosen, 'bytes_pulled') / 1024**4:.2f} | {_mean(chosen, 'hit_pct'):.1f}% | "
                f"{_mean(chosen, 'ttfs_s_mean'):.1f} ({_mean(chosen, 'ttfs_s_p50'):.1f} / {_mean(chosen, 'ttfs_s_p90'):.1f}) | "
                f"{_mean(chosen, 'zero_pull_pct'):.1f}% | {_mean(chosen, 'wait_s_mean'):.0f} | "
                f"{_mean(chosen, 'allocation_pct'):.2f} |"
            )
        blind, aware = by_mode[False], by_mode[True]
        if blind and aware:
            pulled = 1 - _mean(aware, "bytes_pulled") / max(_mean(blind, "bytes_pulled"), 1)
            ttfs = 1 - _mean(aware, "ttfs_s_mean") / max(_mean(blind, "ttfs_s_mean"), 1e-9)
            allocation = [a["allocation_pct"] - b["allocation_pct"] for a, b in zip(aware, blind)]
            notes.append(
                f"{cluster}: cache-aware pulls {100 * pulled:.1f}% fewer bytes and its mean time to first step is "
                f"{100 * ttfs:.1f}% shorter; allocation differs by {min(allocation):+.2f} to {max(allocation):+.2f} "
                f"points per seed (mean {sum(allocation) / len(allocation):+.2f})."
            )
    return "\n".join(lines + [""] + notes)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clusters", default="demo,openb", help="demo, openb or both")
    parser.add_argument("--seeds", default="1-3")
    parser.add_argument("--datasets", type=int, default=64, help="M: datasets in the stream")
    parser.add_argument("--shards", type=int, default=64, help="N: shards per dataset")
    parser.add_argument("--shard-mib", type=float, default=256, help="bytes per shard, MiB")
    parser.add_argument("--cache-gib", type=float, default=64, help="each node's cache, GiB")
    parser.add_argument("--bandwidth-gib-s", type=float, default=1.0, help="storage to one node, GiB/s")
    parser.add_argument("--zipf", type=float, default=1.0, help="exponent of the datasets' popularity")
    parser.add_argument("--load", type=float, default=0.9, help="GPU demand offered, over the cluster's GPUs")
    parser.add_argument("--runtime-min", type=float, default=60, help="mean runtime of a job, minutes")
    parser.add_argument("--jobs-demo", type=int, default=3000)
    parser.add_argument("--jobs-openb", type=int, default=50000)
    parser.add_argument("--pass-limit", type=int, default=64, help="queued jobs a scheduling pass considers")
    parser.add_argument("--tolerance", type=float, default=0, help="points below the best score a cached node may be")
    parser.add_argument("--json", help="append one JSON line per replay to this file")
    args = parser.parse_args(argv)
    rows = []
    for cluster in args.clusters.split(","):
        if cluster not in ("demo", "openb"):
            parser.error(f"unknown cluster {cluster!r}; choose demo or openb")
        for seed in parse_seeds(args.seeds):
            started = time.perf_counter()
            made = run(cluster, seed, args)
            rows += made
            print(f"{cluster} seed {seed}: " + "; ".join(
                f"{'aware' if row['cache_aware'] else 'blind'} pulled {row['bytes_pulled'] / GIB:,.0f} GiB, "
                f"hits {row['hit_pct']:.1f}%, ttfs {row['ttfs_s_mean']:.1f} s, alloc {row['allocation_pct']:.2f}%"
                for row in made) + f" ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
            if args.json:
                with open(args.json, "a") as handle:
                    for row in made:
                        handle.write(json.dumps({**row, "args": vars(args)}) + "\n")
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
