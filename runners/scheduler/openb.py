"""Loaders for Alibaba's openb GPU-sharing trace (cluster-trace-gpu-v2023): node and pod CSV files.

Bad input raises `TraceError` with a message that names the file, the row and the field, so the
replay can print it as one line. The `multigpu*` pod lists have only the first five columns
(name, cpu_milli, memory_mib, num_gpu, gpu_milli); `gpu_spec` is optional everywhere, and so are
`creation_time` and `deletion_time` (seconds from the trace's start; the departures replay needs them).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .model import GPU_MILLI, ClusterState, Gpu, Node, PodRequest

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")


class TraceError(ValueError):
    """A trace file is missing, unreadable or malformed; the message says where and how to fix it."""


@dataclass(frozen=True)
class TracePod:
    """A pod of the trace with its gpu_spec string as written (the typical-pod key uses it)."""

    request: PodRequest
    gpu_spec: str
    # Seconds from the trace's start; None where the list has no times (the multigpu lists).
    created_s: Optional[int] = None
    deleted_s: Optional[int] = None


def _rows(path: Path, required: tuple[str, ...], kind: str) -> list[dict[str, str]]:
    try:
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            columns = reader.fieldnames or []
            missing = [column for column in required if column not in columns]
            if missing:
                raise TraceError(
                    f"{kind} file {path} lacks column(s) {', '.join(missing)}; it needs {', '.join(required)}"
                )
            return list(reader)
    except FileNotFoundError:
        raise TraceError(f"{kind} file {path} does not exist") from None
    except IsADirectoryError:
        raise TraceError(f"{kind} file {path} is a directory, not a CSV file") from None
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise TraceError(f"cannot read {kind} file {path}: {error}") from None


def _whole(path: Path, line: int, row: dict[str, str], column: str) -> int:
    raw = (row.get(column) or "").strip()
    try:
        value = int(float(raw)) if raw not in ("", "nan") else None
    except ValueError:
        value = None
    if value is None or float(raw) != value:
        raise TraceError(f"{path} line {line}: {column} must be a whole number, got {raw!r}")
    if value < 0:
        raise TraceError(f"{path} line {line}: {column} must not be negative, got {value}")
    return value


def load_nodes(path: str | Path) -> list[Node]:
    """The trace's nodes, each with `gpu` GPUs of its model."""
    path = Path(path)
    nodes = []
    for line, row in enumerate(_rows(path, NODE_COLUMNS, "nodes"), start=2):
        gpus = _whole(path, line, row, "gpu")
        model = (row.get("model") or "").strip()
        if gpus and model in ("", "nan"):
            raise TraceError(f"{path} line {line}: a node with {gpus} GPUs needs a model")
        nodes.append(
            Node(
                name=row["sn"].strip(),
                cpu_milli=_whole(path, line, row, "cpu_milli"),
                memory_mib=_whole(path, line, row, "memory_mib"),
                gpus=[Gpu(model=model) for _ in range(gpus)],
            )
        )
    if not nodes:
        raise TraceError(f"nodes file {path} has no nodes")
    return nodes


def load_pods(path: str | Path) -> list[TracePod]:
    """The trace's pods; CPU-only pods have num_gpu 0."""
    path = Path(path)
    pods = []
    for line, row in enumerate(_rows(path, POD_COLUMNS, "pods"), start=2):
        num_gpu = _whole(path, line, row, "num_gpu")
        gpu_milli = _whole(path, line, row, "gpu_milli")
        if gpu_milli > GPU_MILLI:
            raise TraceError(f"{path} line {line}: gpu_milli is per GPU, at most {GPU_MILLI}, got {gpu_milli}")
        if num_gpu > 1 and 0 < gpu_milli < GPU_MILLI:
            raise TraceError(f"{path} line {line}: a GPU share (gpu_milli {gpu_milli}) needs num_gpu 1, got {num_gpu}")
        raw_spec = row.get("gpu_spec") or ""
        models = [model for model in raw_spec.split("|") if model and model != "nan"]
        has_gpu = num_gpu > 0 and gpu_milli > 0
        request = PodRequest(
            name=row["name"].strip(),
            cpu_milli=_whole(path, line, row, "cpu_milli"),
            memory_mib=_whole(path, line, row, "memory_mib"),
            num_gpu=num_gpu if has_gpu else 0,
            gpu_milli=gpu_milli if has_gpu else 0,
            gpu_models=frozenset(models) if models and has_gpu else None,
        )
        times = [None, None]
        for index, column in enumerate(("creation_time", "deletion_time")):
            if (row.get(column) or "").strip() not in ("", "nan"):
                times[index] = _whole(path, line, row, column)
        pods.append(TracePod(request, "|".join(models) if has_gpu else "", *times))
    if not pods:
        raise TraceError(f"pods file {path} has no pods")
    return pods


def inflate(pods: list[TracePod], total_gpus: int, tune: float, rng: np.random.Generator) -> list[TracePod]:
    """Shuffle the name-sorted pods, then add or remove random pods to reach tune x the cluster's GPUs."""
    by_name = sorted(pods, key=lambda pod: pod.request.name)
    order = [by_name[i] for i in rng.permutation(len(by_name))]
    if tune <= 0:
        return order
    target_milli = tune * total_gpus * 1000
    requested_milli = sum(pod.request.total_gpu_milli for pod in order)
    if not any(pod.request.gpu_count for pod in by_name):
        # Copies of pods that ask for no GPU never bring the requested GPUs nearer the target.
        raise ValueError(
            f"the pod list asks for no GPUs, so it cannot be inflated to {tune:g}x the cluster's GPUs; "
            "replay it as it is with --tune 0"
        )
    if requested_milli > target_milli:
        while requested_milli > target_milli and order:
            removed = order.pop(int(rng.integers(len(order))))
            requested_milli -= removed.request.total_gpu_milli
        return order
    copies = 0
    while True:
        original = by_name[int(rng.integers(len(by_name)))]
        if requested_milli + original.request.gpu_milli > target_milli:
            return order
        requested_milli += original.request.total_gpu_milli
        order.append(replace(original, request=replace(original.request, name=f"{original.request.name}-tuned-{copies}")))
        copies += 1


def replay_cluster(nodes: Sequence[Node]) -> ClusterState:
    """The cluster a trace replay places on; a node list without GPUs is refused (ValueError)."""
    state = ClusterState(list(nodes))
    if state.total_gpus == 0:
        raise ValueError(f"the node list has {state.n_nodes} node(s) but no GPUs; a GPU replay needs at least one")
    return state
