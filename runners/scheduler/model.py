"""The placement snapshot: nodes and GPUs in, plain requests to place, and a fast array view of both.

Two layers live here. The dataclasses (`Node`, `Gpu`, `PodRequest`, `Gang`, `Snapshot`) are what
the portal's scheduler cycle builds from the inventory and what tests write by hand. `ClusterState`
is the same cluster as numpy arrays, one row per node and one column per GPU slot, so that a policy
can score every node with a few vector operations instead of a Python loop per node; the trace
replay and the placement functions both work on it and never touch the dataclasses again.

Units are in the names: `cpu_milli` (1000 = one core), `memory_mib`, `gpu_milli` (1000 = one whole
GPU, less is a time-sliced share of one GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

GPU_MILLI = 1000
TOPOLOGIES = ("none", "node", "nvlink", "rack")

# GPU-clustering groups pods by the shape of their GPU request; these are the columns of
# `ClusterState.affinity_pods`, in the order the published simulator names them.
AFFINITY_TAGS = ("share-gpu", "1-gpu", "2-gpu", "4-gpu", "8-gpu", "other-gpu")


@dataclass
class MigInstance:
    """One GPU instance carved out of a MIG-partitioned GPU, and whether a pod holds it."""

    profile: str
    start: int
    pod: Optional[str] = None


@dataclass
class Gpu:
    """One GPU: its model, memory, how much of it is free for sharing, and its MIG layout if partitioned."""

    model: str
    memory_mib: int = 0
    free_milli: int = GPU_MILLI
    nvlink_domain: Optional[str] = None
    # None: not partitioned, shared by milli-GPU. A list (possibly empty): MIG mode, and these
    # instances exist; a MIG GPU takes MIG requests only.
    mig_instances: Optional[list[MigInstance]] = None


@dataclass
class Node:
    """A schedulable machine: CPU, memory, labels, place in the topology, and its GPUs."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: list[Gpu] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    rack: Optional[str] = None
    block: Optional[str] = None
    schedulable: bool = True
    # What is already running there, so a snapshot can start from a busy cluster.
    cpu_used_milli: int = 0
    memory_used_mib: int = 0

    @property
    def gpu_model(self) -> str:
        """The model of the node's GPUs ('' for a CPU-only node); the first GPU speaks for all."""
        return self.gpus[0].model if self.gpus else ""


@dataclass(frozen=True)
class PodRequest:
    """What one pod asks for: CPU, memory, and whole GPUs, a share of one GPU, or a MIG slice."""

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int = 0
    gpu_milli: int = 0
    # None: any GPU model will do; otherwise the models the pod may run on.
    gpu_models: Optional[frozenset[str]] = None
    mig_profile: Optional[str] = None

    def __post_init__(self) -> None:
        for field_name in ("cpu_milli", "memory_mib", "num_gpu", "gpu_milli"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"pod {self.name!r}: {field_name} must be a whole number >= 0, got {value!r}")
        if self.gpu_milli > GPU_MILLI:
            raise ValueError(
                f"pod {self.name!r}: gpu_milli is per GPU and at most {GPU_MILLI}, got {self.gpu_milli}; "
                "ask for more GPUs instead"
            )
        if self.num_gpu > 1 and 0 < self.gpu_milli < GPU_MILLI:
            raise ValueError(
                f"pod {self.name!r}: a share of a GPU (gpu_milli {self.gpu_milli}) is for exactly one GPU, "
                f"not {self.num_gpu}; use gpu_milli={GPU_MILLI} for several whole GPUs"
            )
        if self.mig_profile is not None and (self.num_gpu or self.gpu_milli):
            raise ValueError(f"pod {self.name!r}: a MIG request asks for a profile, not num_gpu or gpu_milli")

    @property
    def gpu_count(self) -> int:
        """GPUs this pod occupies on the milli-GPU path; a pod with gpu_milli 0 is a CPU pod."""
        return self.num_gpu if self.gpu_milli > 0 else 0

    @property
    def total_gpu_milli(self) -> int:
        """Milli-GPUs requested in all: num_gpu x gpu_milli (the trace's 'requested GPUs')."""
        return self.num_gpu * self.gpu_milli

    @property
    def affinity_tag(self) -> Optional[int]:
        """Column of AFFINITY_TAGS this pod counts under, or None for a pod without GPUs."""
        if self.gpu_count == 0:
            return None
        if self.gpu_milli < GPU_MILLI:
            return 0
        return {1: 1, 2: 2, 4: 3, 8: 4}.get(self.num_gpu, 5)


@dataclass(frozen=True)
class Gang:
    """Pods that run together or not at all, optionally inside one node, NVLink domain or rack."""

    name: str
    pods: tuple[PodRequest, ...]
    topology: str = "none"
    required: bool = True

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"gang {self.name!r}: topology must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}")
        if not self.pods:
            raise ValueError(f"gang {self.name!r} has no pods")


@dataclass(frozen=True)
class Snapshot:
    """The cluster as the scheduler sees it at the start of a cycle."""

    nodes: tuple[Node, ...]


@dataclass(frozen=True)
class Placement:
    """Where one pod goes: node, GPU indices on it, and the MIG instance start when it took a slice."""

    pod: str
    node: str
    gpu_indices: tuple[int, ...] = ()
    gpu_milli: int = 0
    mig_profile: Optional[str] = None
    mig_start: Optional[int] = None


@dataclass(frozen=True)
class GangDecision:
    """The outcome for one gang: every pod's placement, or none and the reason it waits."""

    gang: str
    placements: tuple[Placement, ...] = ()
    reason: str = ""

    @property
    def placed(self) -> bool:
        """True when the whole gang was placed."""
        return bool(self.placements)


class ClusterState:
    """The cluster as arrays: one row per node, one column per GPU slot; mutated by `place`."""

    def __init__(self, nodes: list[Node] | tuple[Node, ...]):
        self.node_names = [node.name for node in nodes]
        n_nodes = len(nodes)
        max_gpus = max([len(node.gpus) for node in nodes] + [1])
        self.models: list[str] = sorted({node.gpu_model for node in nodes})
        model_index = {model: i for i, model in enumerate(self.models)}
        self.model_id = np.array([model_index[node.gpu_model] for node in nodes], dtype=np.int64)
        self.cpu_capacity_milli = np.array([node.cpu_milli for node in nodes], dtype=np.int64)
        self.memory_capacity_mib = np.array([node.memory_mib for node in nodes], dtype=np.int64)
        self.cpu_left_milli = self.cpu_capacity_milli - np.array([node.cpu_used_milli for node in nodes], dtype=np.int64)
        self.memory_left_mib = self.memory_capacity_mib - np.array([node.memory_used_mib for node in nodes], dtype=np.int64)
        self.schedulable = np.array([node.schedulable for node in nodes], dtype=bool)
        self.gpu_count = np.array([len(node.gpus) for node in nodes], dtype=np.int64)
        # Padding slots hold 0 free milli: they never fit a GPU request and add nothing to sums.
        self.gpu_left_milli = np.zeros((n_nodes, max_gpus), dtype=np.int64)
        self.gpu_is_mig = np.zeros((n_nodes, max_gpus), dtype=bool)
        self.gpu_nvlink = np.full((n_nodes, max_gpus), -1, dtype=np.int64)
        self.mig: dict[tuple[int, int], list[MigInstance]] = {}
        domains: dict[str, int] = {}
        for row, node in enumerate(nodes):
            for col, gpu in enumerate(node.gpus):
                if gpu.nvlink_domain is not None:
                    self.gpu_nvlink[row, col] = domains.setdefault(gpu.nvlink_domain, len(domains))
                if gpu.mig_instances is not None:
                    # A MIG GPU is not shareable by milli-GPU: leaving it at 0 keeps it out of that path.
                    self.gpu_is_mig[row, col] = True
                    self.mig[(row, col)] = [MigInstance(i.profile, i.start, i.pod) for i in gpu.mig_instances]
                else:
                    self.gpu_left_milli[row, col] = gpu.free_milli
        self.gpu_models = [[gpu.model for gpu in node.gpus] for node in nodes]
        self.nvlink_domain_names = list(domains)
        racks: dict[Optional[str], int] = {}
        self.rack_id = np.array([racks.setdefault(node.rack, len(racks)) for node in nodes], dtype=np.int64)
        self.rack_names = list(racks)
        self.affinity_pods = np.zeros((n_nodes, len(AFFINITY_TAGS)), dtype=np.int64)
        # Bumped on every change to a node, so policies can cache per-node scores and rescore only those.
        self.version = np.zeros(n_nodes, dtype=np.int64)
        # Equal scores go to the node ranked first here. The published simulator's scheduler breaks
        # ties by node order, and it names nodes with a random prefix per seed; the replay sets a
        # seeded permutation, a snapshot keeps its own order.
        self.tie_rank = np.arange(n_nodes, dtype=np.int64)
        self._refresh_summaries(np.arange(n_nodes))

    @property
    def n_nodes(self) -> int:
        """Number of nodes."""
        return len(self.node_names)

    @property
    def total_gpus(self) -> int:
        """GPUs in the cluster, MIG ones included."""
        return int(self.gpu_count.sum())

    def allocated_gpu_milli(self) -> int:
        """Milli-GPUs handed out on the sharing path (whole GPUs count 1000 each)."""
        capacity = (self.gpu_count * GPU_MILLI - self.gpu_is_mig.sum(axis=1) * GPU_MILLI).sum()
        return int(capacity - self.total_left_milli.sum())

    def _refresh_summaries(self, rows: np.ndarray) -> None:
        left = self.gpu_left_milli[rows]
        if rows.size == self.n_nodes:
            self.total_left_milli = left.sum(axis=1)
            self.max_left_milli = left.max(axis=1)
            self.full_free_gpus = (left == GPU_MILLI).sum(axis=1)
        else:
            self.total_left_milli[rows] = left.sum(axis=1)
            self.max_left_milli[rows] = left.max(axis=1)
            self.full_free_gpus[rows] = (left == GPU_MILLI).sum(axis=1)

    def model_access(self, pod: PodRequest) -> np.ndarray:
        """Per model id, whether the pod may use that model (the trace's gpu_spec rule)."""
        if pod.gpu_models is None:
            return np.array([model != "" for model in self.models], dtype=bool)
        return np.array([model in pod.gpu_models for model in self.models], dtype=bool)

    def feasible(self, pod: PodRequest, mask: Optional[np.ndarray] = None) -> np.ndarray:
        """Indices of nodes that can take the pod now (CPU, memory, GPU model and free GPU share)."""
        ok = self.schedulable & (self.cpu_left_milli >= pod.cpu_milli) & (self.memory_left_mib >= pod.memory_mib)
        if mask is not None:
            ok &= mask
        gpus = pod.gpu_count
        if gpus:
            ok &= self.model_access(pod)[self.model_id]
            if pod.gpu_milli == GPU_MILLI:
                ok &= self.full_free_gpus >= gpus
            else:
                ok &= self.max_left_milli >= pod.gpu_milli
        return np.flatnonzero(ok)

    def place(self, row: int, pod: PodRequest, gpu_indices: tuple[int, ...]) -> None:
        """Take the pod's CPU, memory and GPU share on node `row`; the caller checked it fits."""
        self.cpu_left_milli[row] -= pod.cpu_milli
        self.memory_left_mib[row] -= pod.memory_mib
        if pod.gpu_count:
            for col in gpu_indices:
                self.gpu_left_milli[row, col] -= pod.gpu_milli
            self.affinity_pods[row, pod.affinity_tag] += 1
            self._refresh_summaries(np.array([row]))
        self.version[row] += 1

    def best_fit_gpu(self, row: int, gpu_milli: int) -> int:
        """The GPU a share goes to under the simulator's 'best' rule: the tightest fit, lowest index first."""
        left = self.gpu_left_milli[row]
        candidates = np.flatnonzero(left >= gpu_milli)
        return int(candidates[np.argmin(left[candidates])])

    def whole_gpus(self, row: int, count: int) -> tuple[int, ...]:
        """The first `count` fully free GPUs of a node, by index (the simulator's exclusive rule)."""
        return tuple(int(col) for col in np.flatnonzero(self.gpu_left_milli[row] == GPU_MILLI)[:count])

    def default_gpus(self, row: int, pod: PodRequest) -> tuple[int, ...]:
        """GPU indices for a pod on a node when the policy has no opinion of its own."""
        if not pod.gpu_count:
            return ()
        if pod.gpu_milli < GPU_MILLI:
            return (self.best_fit_gpu(row, pod.gpu_milli),)
        return self.whole_gpus(row, pod.gpu_count)
