"""The placement snapshot: nodes and GPUs in, plain requests to place, and a fast array view of both.

Two layers live here. The dataclasses (`Node`, `Gpu`, `PodRequest`, `Gang`, `Snapshot`) are what
the portal's scheduler cycle builds from the inventory and what tests write by hand. `ClusterState`
is the same cluster as numpy arrays, one row per node and one column per GPU slot, so that a policy
can score every node with a few vector operations instead of a Python loop per node; the trace
replay and the placement functions both work on it and never touch the dataclasses again. Every
change to a `ClusterState` goes through its methods (`place`, `place_mig`, `hide_gpus_outside`),
which stamp the node with a new version; `copy()` gives a scratch state to try placements on.

Units are in the names: `cpu_milli` (1000 = one core), `memory_mib`, `gpu_milli` (1000 = one whole
GPU, less is a time-sliced share of one GPU).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, Optional, Sequence, Union, get_args

import numpy as np

from runners.nvidia import mig

GPU_MILLI = 1000

# Where a gang's pods must (or, not required, should) run together: anywhere, on one node, inside
# one NVLink domain, or in one rack.
Topology = Literal["none", "node", "nvlink", "rack"]
TOPOLOGIES: tuple[Topology, ...] = get_args(Topology)

# How a GPU is cut up: shared by milli-GPU (whole GPUs are 1000 of it), or MIG-partitioned.
Partitioning = Literal["shared", "mig"]

# What a pod asks for: no GPU, a share of one GPU, whole GPUs, or a MIG slice.
RequestKind = Literal["cpu", "share", "whole", "mig"]

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

    @property
    def partitioning(self) -> Partitioning:
        """'mig' for a MIG-partitioned GPU, 'shared' for one shared by milli-GPU."""
        return "shared" if self.mig_instances is None else "mig"


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
    def kind(self) -> RequestKind:
        """'mig' for a MIG slice, else 'cpu' without GPUs, 'whole' for whole GPUs, 'share' for part of one."""
        if self.mig_profile is not None:
            return "mig"
        if self.gpu_count == 0:
            return "cpu"
        return "whole" if self.gpu_milli == GPU_MILLI else "share"

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


# Bytes of a gang's data held by each node's cache: a mapping of node name to bytes, or its items.
CachedBytes = Union[Mapping[str, int], Iterable[tuple[str, int]]]


@dataclass(frozen=True)
class Gang:
    """Pods that run together or not at all, optionally inside one node, NVLink domain or rack."""

    name: str
    pods: tuple[PodRequest, ...]
    topology: Topology = "none"
    # False: the topology is a preference, and the gang spreads over the cluster when no domain fits.
    required: bool = True
    # How many bytes of the gang's data (its datasets' shards, a serving replica's weights) each
    # node's cache holds already, by node name; a node not named holds none. Placement prefers,
    # among the nodes its policy finds as good, those holding more (placement.py says exactly
    # when). Given as a mapping or pairs; kept as (name, bytes) pairs sorted by name, without
    # zeros, so that a gang stays hashable and two gangs with the same data compare equal.
    cached_bytes: CachedBytes = ()

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"gang {self.name!r}: topology must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}")
        if not self.pods:
            raise ValueError(f"gang {self.name!r} has no pods")
        cached = self.cached_bytes.items() if isinstance(self.cached_bytes, Mapping) else self.cached_bytes
        pairs = []
        for node_name, count in cached:
            if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
                raise ValueError(
                    f"gang {self.name!r}: cached_bytes of node {node_name!r} must be a whole number >= 0, got {count!r}"
                )
            if count:
                pairs.append((str(node_name), int(count)))
        names = [node_name for node_name, _ in pairs]
        if len(set(names)) != len(names):
            raise ValueError(f"gang {self.name!r}: cached_bytes names a node more than once")
        object.__setattr__(self, "cached_bytes", tuple(sorted(pairs)))


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


class _VersionClock:
    """Hands out node versions: one counter for a cluster state and every copy made of it.

    Policies cache per-node scores under (row, version) and reuse them for as long as the node's
    version is unchanged. Copies start from their original's versions and then go separate ways,
    so if each counted on its own, two of them could stamp the same version on different contents
    and a cache would mistake one for the other. Drawing every version from one counter means a
    (row, version) pair names one content of that node, in whichever copy it is read.
    """

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = 0

    def tick(self) -> int:
        """A version no state of this family has used yet."""
        self.last += 1
        return self.last


class ClusterState:
    """The cluster as arrays: one row per node, one column per GPU slot; changed only by its own methods.

    The layout (names, capacities, models, topology) is fixed once built and shared by copies; its
    arrays are read-only. The tie order is layout too: the replay replaces it as a whole before it
    places anything, nothing writes into it. What placements change (the `_OCCUPANCY` arrays and
    the MIG layouts) belongs to each copy.
    """

    # No trial open (see `trial`).
    _undo: Optional[dict] = None
    # While placement places one gang: how many bytes of that gang's data each node (row) holds, and
    # how many points below the best score a node holding more may be and still be taken
    # (`policies.pick_max`). None outside a gang with cached data: ties go by `tie_rank` alone.
    held_bytes: Optional[np.ndarray] = None
    held_tolerance_points: float = 0

    # The arrays `copy()` copies; every other array is layout, read-only and shared.
    _OCCUPANCY = (
        "cpu_left_milli",
        "memory_left_mib",
        "gpu_left_milli",
        "gpu_is_mig",
        "affinity_pods",
        "version",
        "total_left_milli",
        "max_left_milli",
        "full_free_gpus",
    )

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
                if gpu.partitioning == "mig":
                    # A MIG GPU is not shareable by milli-GPU: leaving it at 0 keeps it out of that path.
                    self.gpu_is_mig[row, col] = True
                    self.mig[(row, col)] = [replace(instance) for instance in gpu.mig_instances]
                else:
                    self.gpu_left_milli[row, col] = gpu.free_milli
        self.gpu_models = [[gpu.model for gpu in node.gpus] for node in nodes]
        self.nvlink_domain_names = list(domains)
        racks: dict[Optional[str], int] = {}
        self.rack_id = np.array([racks.setdefault(node.rack, len(racks)) for node in nodes], dtype=np.int64)
        self.rack_names = list(racks)
        self.affinity_pods = np.zeros((n_nodes, len(AFFINITY_TAGS)), dtype=np.int64)
        # Stamped anew (from the clock every copy shares) on every change to a node, so policies
        # can cache per-node scores and rescore only the nodes that changed.
        self._clock = _VersionClock()
        self.version = np.zeros(n_nodes, dtype=np.int64)
        # Equal scores go to the node ranked first here. The published simulator's scheduler breaks
        # ties by node order, and it names nodes with a random prefix per seed; the replay sets a
        # seeded permutation, a snapshot keeps its own order.
        self.tie_rank = np.arange(n_nodes, dtype=np.int64)
        # Each node's row by name, layout like the names (shared by copies).
        self.row_of = {name: row for row, name in enumerate(self.node_names)}
        # The nodes with GPUs, and (filled as asked, see `model_rows`) the nodes of the models a pod
        # may use: layout too. On a cluster of many models they are a fraction of the nodes.
        self.gpu_rows = np.flatnonzero(self.gpu_count > 0)
        self._model_rows: dict[Optional[frozenset[str]], np.ndarray] = {}
        # What a trial changed, to undo it (see `trial`); None when no trial is open.
        self._undo: Optional[dict] = None
        self._refresh_summaries(np.arange(n_nodes))
        for name, value in vars(self).items():
            if isinstance(value, np.ndarray) and name not in self._OCCUPANCY:
                value.setflags(write=False)

    def copy(self) -> ClusterState:
        """A scratch copy to try placements on: its own occupancy and MIG layouts, the layout shared.

        The copy draws versions from the same clock as this state, so a policy's per-node caches
        stay valid for both of them and for every other copy (see `_VersionClock`).
        """
        clone = object.__new__(ClusterState)
        clone.__dict__.update(vars(self))
        for name in self._OCCUPANCY:
            setattr(clone, name, getattr(self, name).copy())
        clone.mig = {slot: [replace(instance) for instance in instances] for slot, instances in self.mig.items()}
        clone._undo = None
        return clone

    # --- trials: placements tried in place and undone, instead of on a copy ---------------------

    def trial(self) -> None:
        """Start a trial: from now on `place` and `place_mig` remember what each node was before,
        so `undo` puts it back, versions included, as if the placements had been made on a copy
        (`copy`) and the copy dropped; `keep` ends the trial and keeps them. A trial costs what
        the nodes it touches cost, where a copy costs the whole cluster."""
        self._undo = {}

    def _remember(self, row: int, slot: Optional[tuple[int, int]] = None) -> None:
        undo = self._undo
        if undo is None:
            return
        if row not in undo:
            undo[row] = (
                self.cpu_left_milli[row], self.memory_left_mib[row], self.gpu_left_milli[row].copy(),
                self.affinity_pods[row].copy(), self.version[row], self.total_left_milli[row],
                self.max_left_milli[row], self.full_free_gpus[row],
            )
        if slot is not None and slot not in undo:
            undo[slot] = [replace(instance) for instance in self.mig[slot]]

    def undo(self) -> None:
        """Put back every node the trial changed, with the version it had, and end the trial."""
        undo, self._undo = self._undo, None
        for key, saved in (undo or {}).items():
            if isinstance(key, tuple):
                self.mig[key] = saved
                continue
            row = key
            (self.cpu_left_milli[row], self.memory_left_mib[row], self.gpu_left_milli[row], self.affinity_pods[row],
             self.version[row], self.total_left_milli[row], self.max_left_milli[row], self.full_free_gpus[row]) = saved

    def keep(self, placed_rows: Sequence[int] = ()) -> None:
        """End the trial, keeping what it placed; ``placed_rows``, the node of each pod placed, in order,
        are stamped anew one after another, as placing those pods again on this state would stamp them.

        That keeps every version, and so what a policy finds stale, exactly as when the trial ran on a
        copy and its placements were then made here. It matters: FGD's fragmentation is a floating
        point sum computed for the stale nodes together, and a different batch can round a score
        across a step and move a decision.
        """
        self._undo = None
        for row in placed_rows:
            self.version[row] = self._clock.tick()

    def held_by_row(self, cached_bytes: Iterable[tuple[str, int]]) -> Optional[np.ndarray]:
        """Bytes held per node row, from (node name, bytes) pairs (`Gang.cached_bytes`); None when no
        node of this state holds any (names of nodes outside it are left out)."""
        held = None
        for node_name, count in cached_bytes:
            row = self.row_of.get(node_name)
            if row is None or count <= 0:
                continue
            if held is None:
                held = np.zeros(self.n_nodes, dtype=np.int64)
            held[row] = count
        return held

    def same_family(self, other: ClusterState) -> bool:
        """True when `other` is this state or a copy of it (or of a copy): their versions compare."""
        return other._clock is self._clock

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

    def model_rows(self, pod: PodRequest) -> np.ndarray:
        """The nodes, ascending, whose GPU model the pod may use (the `model_access` rule)."""
        rows = self._model_rows.get(pod.gpu_models)
        if rows is None:
            rows = self._model_rows[pod.gpu_models] = np.flatnonzero(self.model_access(pod)[self.model_id])
            rows.setflags(write=False)
        return rows

    def feasible(self, pod: PodRequest, mask: Optional[np.ndarray] = None, rows: Optional[np.ndarray] = None) -> np.ndarray:
        """Indices of nodes that can take the pod now (CPU, memory, GPU model and free GPU share).

        ``rows`` (ascending node indices) asks about those nodes only, at their cost rather than the
        whole cluster's: the answer is the same as with a mask of just those rows.
        """
        if rows is not None:
            ok = (self.schedulable[rows] & (self.cpu_left_milli[rows] >= pod.cpu_milli)
                  & (self.memory_left_mib[rows] >= pod.memory_mib))
            if mask is not None:
                ok &= mask[rows]
            kind = pod.kind
            if kind in ("share", "whole"):
                ok &= self.model_access(pod)[self.model_id[rows]]
                if kind == "whole":
                    ok &= self.full_free_gpus[rows] >= pod.gpu_count
                else:
                    ok &= self.max_left_milli[rows] >= pod.gpu_milli
            return rows[ok]
        ok = self.schedulable & (self.cpu_left_milli >= pod.cpu_milli) & (self.memory_left_mib >= pod.memory_mib)
        if mask is not None:
            ok &= mask
        kind = pod.kind
        if kind in ("share", "whole"):
            ok &= self.model_access(pod)[self.model_id]
            if kind == "whole":
                ok &= self.full_free_gpus >= pod.gpu_count
            else:
                ok &= self.max_left_milli >= pod.gpu_milli
        return np.flatnonzero(ok)

    # --- changes: each one stamps the nodes it touches with a new version -------------------------

    def place(self, row: int, pod: PodRequest, gpu_indices: tuple[int, ...]) -> None:
        """Take the pod's CPU, memory and GPU share on node `row`; the caller checked it fits."""
        self._remember(row)
        self.cpu_left_milli[row] -= pod.cpu_milli
        self.memory_left_mib[row] -= pod.memory_mib
        if pod.gpu_count:
            for col in gpu_indices:
                self.gpu_left_milli[row, col] -= pod.gpu_milli
            self.affinity_pods[row, pod.affinity_tag] += 1
            self._refresh_summaries(np.array([row]))
        self.version[row] = self._clock.tick()

    def release(self, row: int, pod: PodRequest, gpu_indices: tuple[int, ...]) -> None:
        """Give back what `place` took for the pod on node `row`: a pod that ended (a replay with departures).

        The caller placed it there with these GPUs; giving back more than the node has is refused.
        MIG slices are not given back here (their instances stay in the layout).
        """
        if pod.kind == "mig":
            raise ValueError(f"pod {pod.name!r}: MIG slices are not released through ClusterState.release")
        cpu = self.cpu_left_milli[row] + pod.cpu_milli
        memory = self.memory_left_mib[row] + pod.memory_mib
        gpus = self.gpu_left_milli[row].copy()
        if pod.gpu_count:
            for col in gpu_indices:
                gpus[col] += pod.gpu_milli
        if cpu > self.cpu_capacity_milli[row] or memory > self.memory_capacity_mib[row] or (gpus > GPU_MILLI).any():
            raise ValueError(f"pod {pod.name!r} was not placed on node {self.node_names[row]!r} with GPUs {gpu_indices}")
        self._remember(row)
        self.cpu_left_milli[row] = cpu
        self.memory_left_mib[row] = memory
        if pod.gpu_count:
            self.gpu_left_milli[row] = gpus
            self.affinity_pods[row, pod.affinity_tag] -= 1
            self._refresh_summaries(np.array([row]))
        self.version[row] = self._clock.tick()

    def place_mig(self, row: int, col: int, start: int, pod: PodRequest) -> None:
        """Give a MIG pod its instance at `start` on GPU `col` of node `row`: the idle one there, or a new one.

        The one path for MIG bookkeeping, whether a placement is tried on a scratch copy or applied;
        the caller found the slot with `mig_free_starts` or an idle instance of `mig_layout`.
        """
        self._remember(row, (row, col))
        instances = self.mig[(row, col)]
        idle = next(
            (i for i in instances if i.profile == pod.mig_profile and i.start == start and i.pod is None), None
        )
        if idle is not None:
            idle.pod = pod.name
        else:
            instances.append(MigInstance(pod.mig_profile, start, pod.name))
            # The layout must stay one NVIDIA accepts; free starts guarantee it, this keeps it checked.
            mig.check_placement(self.gpu_models[row][col], self.mig_layout(row, col))
        self.cpu_left_milli[row] -= pod.cpu_milli
        self.memory_left_mib[row] -= pod.memory_mib
        self.version[row] = self._clock.tick()

    def hide_gpus_outside(self, gpu_mask: np.ndarray) -> None:
        """Make every GPU outside the mask look fully taken (and not MIG), for a gang confined to those GPUs."""
        if self._undo is not None:
            raise RuntimeError("hide_gpus_outside changes every node: use it on a copy, not inside a trial")
        hidden = ~gpu_mask
        changed = (hidden & ((self.gpu_left_milli != 0) | self.gpu_is_mig)).any(axis=1)
        self.gpu_left_milli[hidden] = 0
        self.gpu_is_mig[hidden] = False
        self._refresh_summaries(np.arange(self.n_nodes))
        self.version[changed] = self._clock.tick()

    # --- MIG layouts --------------------------------------------------------------------------------

    def mig_layout(self, row: int, col: int) -> list[tuple[str, int]]:
        """(profile, start) of every instance on a MIG GPU, held or idle, as `mig` checks layouts."""
        return [(instance.profile, instance.start) for instance in self.mig[(row, col)]]

    def mig_free_slices(self, row: int, col: int) -> int:
        """Memory slices of a MIG GPU that no instance covers."""
        profiles = mig.profiles_for(self.gpu_models[row][col])
        return mig.MEMORY_SLICES - sum(profiles[instance.profile].span for instance in self.mig[(row, col)])

    def mig_free_starts(self, row: int, col: int, profile: str) -> list[int]:
        """Starts where a new instance of `profile` fits on a MIG GPU without moving anything."""
        return mig.free_starts(self.gpu_models[row][col], self.mig_layout(row, col), profile)

    # --- GPU choice on a node -----------------------------------------------------------------------

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
        kind = pod.kind
        if kind == "share":
            return (self.best_fit_gpu(row, pod.gpu_milli),)
        if kind == "whole":
            return self.whole_gpus(row, pod.gpu_count)
        return ()
