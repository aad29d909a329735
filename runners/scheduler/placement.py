"""Place gangs on a snapshot: all-or-nothing, inside the topology they ask for, MIG slices by NVIDIA's rules.

This is what the portal's scheduler cycle calls once admission has decided which gangs may run:
`place_gangs(snapshot, gangs)` returns one `GangDecision` per gang, in order, each either a
placement for every pod or a reason the gang waits. Earlier gangs' placements are taken into
account by later ones. Nothing here mutates the snapshot.

A gang is tried domain by domain (the whole cluster, each node, each NVLink domain or each rack),
its pods placed one after another with the chosen policy, as a trial on the cluster state that is
undone when a pod finds no room (`ClusterState.trial`; an NVLink domain, which hides the GPUs
outside it, is tried on a scratch copy, `ClusterState.copy`); the first domain that takes every pod
wins. A one-node domain is its row, not a mask over every node, so that trying it costs what one
node costs: on a cluster of 20,000 nodes a mask per node tried made the cycle quadratic. A
preferred constraint (`required` False) falls back to the whole cluster when no domain fits; a
required one makes the gang wait. The policy is built once per call, so FGD's per-node scores carry
over from domain to domain and from gang to gang instead of being recomputed for every trial.

Cached data (`Gang.cached_bytes`: how many bytes of the gang's datasets or weights each node's
cache holds) only breaks ties between placements that are otherwise as good, in three places:

* a pod's node: among the feasible nodes whose policy score is the best one, or within
  `cache_tolerance_points` of it (default `CACHE_TOLERANCE_POINTS`, 0: the same whole-point score;
  for FGD and `portal` one point is about 40 milli-GPU of fragmentation growth near zero), the one
  holding most of the gang's bytes wins, then the best score, then the usual node order
  (`policies.pick_max`). A MIG slot: among the slots equal in idle-instance reuse and best fit, the
  node holding most wins, then the usual order.
* a gang's domain (one node, NVLink domain or rack): the plain order takes the first domain of the
  topology that fits. Another domain of the same topology is as good when the policy's best score
  for the gang's first pod on its nodes is at least that on the first domain's, less the same
  tolerance; of those that fit, the one holding most of the gang's bytes (summed over its nodes)
  wins, and only if it holds more than the first (`_place_preferring`). The tier never changes: a
  preferred topology still tries every domain of it before the whole cluster, and a gang with MIG
  pods keeps the plain order of domains.
* never at the cost of a place: a gang of several pods whose cache-preferring trial finds no room
  in a domain is tried there again in the plain order, so a gang placed without cached data is
  placed with it too. A pod never waits for a node holding its data while another fits.

With no bytes held, or the same bytes held on every node, placement is exactly what it is without
(the scheduler's fingerprint tests pin it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from runners.nvidia import mig

from .model import ClusterState, Gang, GangDecision, Placement, PodRequest, Snapshot, Topology
from .policies import Policy, PolicyName, TypicalPod, make_policy, typical_pods

# How a waiting gang's reason names the domains it did not fit in, and the one it needs.
_ANY_DOMAIN: dict[Topology, str] = {
    "none": "the cluster",
    "node": "any one node",
    "rack": "any one rack",
    "nvlink": "any one NVLink domain",
}
_ONE_DOMAIN: dict[Topology, str] = {"node": "one node", "rack": "one rack", "nvlink": "one NVLink domain"}

# How many points below the best score a node holding more of a gang's cached bytes may score and
# still be taken (see the module's note). 0: only nodes of the best score are as good.
CACHE_TOLERANCE_POINTS = 0


def _misfit_reason(gang: Gang, pod_name: str) -> str:
    """Why a gang found no room, in its owner's words: its replicas, not pods or gangs."""
    # A preferred topology was tried on the whole cluster last.
    where = _ANY_DOMAIN[gang.topology if gang.required else "none"]
    if len(gang.pods) == 1:
        return f"it does not fit in {where} now: no node has the GPUs, CPU and memory it asks for free"
    rank = next(index for index, pod in enumerate(gang.pods) if pod.name == pod_name)
    return f"its {len(gang.pods)} replicas do not fit together in {where} now (replica {rank} found no room)"


@dataclass(frozen=True)
class Domain:
    """One place a gang may go: its nodes, and its GPUs when it is narrower than whole nodes (NVLink).

    The nodes are a mask (``nodes``), or a few rows (``rows``, ascending node indices: one node),
    or, both None, the whole cluster.
    """

    nodes: Optional[np.ndarray] = None  # bool per node
    gpus: Optional[np.ndarray] = None  # bool per (node, GPU slot); None: every GPU of those nodes
    rows: Optional[np.ndarray] = None

    def mask(self, n_nodes: int) -> np.ndarray:
        """The domain's nodes as a mask over every node."""
        if self.nodes is not None:
            return self.nodes
        if self.rows is None:
            return np.ones(n_nodes, dtype=bool)
        mask = np.zeros(n_nodes, dtype=bool)
        mask[self.rows] = True
        return mask


def _one_node(row: int) -> Domain:
    return Domain(rows=np.array([row], dtype=np.int64))


@dataclass(frozen=True)
class MigSlot:
    """Somewhere a MIG pod could go now: an idle instance of its profile, or free slices to carve one from."""

    row: int
    col: int
    start: int
    reuses_idle: bool


def _domains(state: ClusterState, topology: Topology) -> list[Domain]:
    """Each place a gang with this topology may go, in the order they are tried."""
    if topology == "none":
        return [Domain()]
    if topology == "node":
        return [_one_node(row) for row in range(state.n_nodes)]
    if topology == "rack":
        return [Domain(state.rack_id == rack) for rack, name in enumerate(state.rack_names) if name is not None]
    domains = []
    for domain in range(len(state.nvlink_domain_names)):
        gpus = state.gpu_nvlink == domain
        domains.append(Domain(gpus.any(axis=1), gpus))
    return domains


def _mig_slots(state: ClusterState, pod: PodRequest, node_mask: np.ndarray) -> list[MigSlot]:
    """Every MIG slot the pod could take now, on nodes with room for its CPU and memory."""
    ok = state.schedulable & node_mask & (state.cpu_left_milli >= pod.cpu_milli) & (state.memory_left_mib >= pod.memory_mib)
    slots = []
    for (row, col), instances in state.mig.items():
        if not ok[row] or not state.gpu_is_mig[row, col]:
            continue
        model = state.gpu_models[row][col]
        if pod.gpu_models is not None and model not in pod.gpu_models:
            continue
        try:
            profiles = mig.profiles_for(model)
        except mig.MigError:
            continue
        if pod.mig_profile not in profiles:
            continue
        for instance in instances:
            if instance.profile == pod.mig_profile and instance.pod is None:
                slots.append(MigSlot(row, col, instance.start, reuses_idle=True))
        for start in state.mig_free_starts(row, col, pod.mig_profile):
            slots.append(MigSlot(row, col, start, reuses_idle=False))
    return slots


def _place_mig(state: ClusterState, pod: PodRequest, node_mask: np.ndarray) -> Optional[Placement]:
    slots = _mig_slots(state, pod, node_mask)
    if not slots:
        return None
    # An idle existing instance first (no repartitioning), then the GPU with the fewest free
    # memory slices (best fit), then the node holding most of the gang's cached bytes, then the
    # lowest start, which leaves the high slots contiguous.
    held = state.held_bytes
    slot = min(
        slots,
        key=lambda s: (not s.reuses_idle, state.mig_free_slices(s.row, s.col), 0 if held is None else -held[s.row],
                       state.tie_rank[s.row], s.col, s.start),
    )
    state.place_mig(slot.row, slot.col, slot.start, pod)
    return Placement(pod.name, state.node_names[slot.row], (slot.col,), 0, pod.mig_profile, slot.start)


def _place_one(
    state: ClusterState, pod: PodRequest, policy: Policy, domain: Domain, rng: np.random.Generator
) -> Optional[Placement]:
    if pod.kind == "mig":
        return _place_mig(state, pod, domain.mask(state.n_nodes))
    rows = domain.rows
    if rows is None and pod.kind in ("share", "whole"):
        # Only nodes of a model it may use can take a GPU pod: asking about those alone gives the
        # same answer at their cost, not the cluster's (the cycle's snapshot of one flavor holds
        # every node, most of them without that flavor's GPUs).
        rows = state.model_rows(pod)
    feasible = state.feasible(pod, domain.nodes, rows)
    if feasible.size == 0:
        return None
    row, gpus = policy.select(state, pod, feasible, rng)
    state.place(row, pod, gpus)
    return Placement(pod.name, state.node_names[row], tuple(gpus), pod.gpu_milli if gpus else 0)


def _could_hold(state: ClusterState, gang: Gang, domain: Domain) -> bool:
    """A cheap necessary condition, so that most domains are skipped without a trial placement:
    the domain's schedulable nodes have, together, the CPU, memory and GPU share the gang asks for."""
    if domain.rows is not None:
        # Indices instead of a mask: the cost of the domain's nodes, not of the cluster's.
        nodes = domain.rows[state.schedulable[domain.rows]]
    else:
        nodes = state.schedulable if domain.nodes is None else domain.nodes & state.schedulable
        if not nodes.any():
            return False
    if nodes.size == 0:
        return False
    cpu = sum(pod.cpu_milli for pod in gang.pods)
    memory = sum(pod.memory_mib for pod in gang.pods)
    gpu_milli = sum(pod.total_gpu_milli for pod in gang.pods if pod.gpu_count)
    if domain.gpus is None:
        # The per-node sums ClusterState keeps: a node's free GPU share over its GPUs.
        gpu_left = state.total_left_milli[nodes].sum()
    else:
        gpu_left = np.where(domain.gpus, state.gpu_left_milli, 0)[nodes].sum()
    return (
        state.cpu_left_milli[nodes].sum() >= cpu
        and state.memory_left_mib[nodes].sum() >= memory
        and gpu_left >= gpu_milli
    )


def _rows_that_could_hold(state: ClusterState, gang: Gang) -> np.ndarray:
    """The nodes that, each on its own, pass `_could_hold` for the whole gang."""
    cpu = sum(pod.cpu_milli for pod in gang.pods)
    memory = sum(pod.memory_mib for pod in gang.pods)
    gpu_milli = sum(pod.total_gpu_milli for pod in gang.pods if pod.gpu_count)
    if gpu_milli > 0:
        # Only nodes with GPUs can have the free share: the same rows, found among those alone.
        rows = state.gpu_rows
        fits = (
            state.schedulable[rows]
            & (state.cpu_left_milli[rows] >= cpu)
            & (state.memory_left_mib[rows] >= memory)
            & (state.total_left_milli[rows] >= gpu_milli)
        )
        return rows[fits]
    fits = (
        state.schedulable
        & (state.cpu_left_milli >= cpu)
        & (state.memory_left_mib >= memory)
        & (state.total_left_milli >= gpu_milli)
    )
    return np.flatnonzero(fits)


class _SeededOnUse:
    """``np.random.default_rng(seed)``, made when a policy first draws from it: most policies never
    do, and making one costs more than a one-node trial."""

    __slots__ = ("_seed", "_generator")

    def __init__(self, seed: int) -> None:
        self._seed, self._generator = seed, None

    def __getattr__(self, name: str):
        if self._generator is None:
            self._generator = np.random.default_rng(self._seed)
        return getattr(self._generator, name)


def _try_domain(
    state: ClusterState, gang: Gang, policy: Policy, domain: Domain, seed: int,
    held: Optional[np.ndarray] = None, tolerance_points: float = 0, keep: bool = True,
) -> tuple[Optional[list[Placement]], str, bool]:
    """The gang's placements inside the domain; or None and the pod that did not fit.

    The third value says whether the placements are made on `state` already: they are tried there
    and undone when a pod does not fit, except in an NVLink domain (GPUs hidden), tried on a copy.
    ``held``: bytes of the gang's data per node, for the policy's tie-break (`policies.pick_max`).
    ``keep`` False: the placements are found and undone (a look, not a decision).
    """
    scratch = state
    if domain.gpus is not None:
        scratch = state.copy()
        scratch.hide_gpus_outside(domain.gpus)
    else:
        state.trial()
    scratch.held_bytes, scratch.held_tolerance_points = held, tolerance_points
    # Every trial draws from the same seed, so a gang's random-fit choices do not depend on how
    # many domains were tried before.
    rng = _SeededOnUse(seed)
    placements: Optional[list[Placement]] = []
    last_pod = ""
    try:
        for pod in gang.pods:
            placement = _place_one(scratch, pod, policy, domain, rng)
            if placement is None:
                placements, last_pod = None, pod.name
                break
            placements.append(placement)
    finally:
        scratch.held_bytes, scratch.held_tolerance_points = None, 0
        if scratch is state:
            # Kept only when every pod found room; undone otherwise, or when something raised.
            if keep and placements is not None and len(placements) == len(gang.pods):
                state.keep([state.row_of[placement.node] for placement in placements])
            else:
                state.undo()
    return placements, last_pod, keep and scratch is state and placements is not None


def _apply(state: ClusterState, gang: Gang, placements: list[Placement]) -> None:
    """Make a gang's placements, found on a scratch copy, on the cycle's state."""
    for pod, placement in zip(gang.pods, placements):
        row = state.row_of[placement.node]
        if pod.kind == "mig":
            state.place_mig(row, placement.gpu_indices[0], placement.mig_start, pod)
        else:
            state.place(row, pod, placement.gpu_indices)


def place_gangs(
    snapshot: Snapshot,
    gangs: Sequence[Gang],
    policy: PolicyName = "portal",
    typical: Optional[list[TypicalPod]] = None,
    seed: int = 0,
    cache_tolerance_points: float = CACHE_TOLERANCE_POINTS,
) -> list[GangDecision]:
    """Decide, gang by gang in the given order, where each gang's pods go or why it waits."""
    state = ClusterState(list(snapshot.nodes))
    if typical is None:
        # Without a workload history, the pods in this cycle are the best guess of what comes next.
        pods = [pod for gang in gangs for pod in gang.pods if pod.kind != "mig"]
        typical = typical_pods(pods or [PodRequest("cpu", 1000, 1024)], with_memory=policy == "portal")
    # One policy for the whole call: every trial state is a copy of `state`, so its caches hold.
    chooser = make_policy(policy, typical)
    return place_gangs_on(state, gangs, chooser, seed=seed, cache_tolerance_points=cache_tolerance_points)


def place_gangs_on(
    state: ClusterState,
    gangs: Sequence[Gang],
    chooser: Policy,
    seed: int = 0,
    cache_tolerance_points: float = CACHE_TOLERANCE_POINTS,
) -> list[GangDecision]:
    """`place_gangs` on a cluster state the caller keeps: each placed gang is made on it.

    A replay that keeps one state and one policy for a whole stream of gangs (pods leaving through
    `ClusterState.release`) places through this, as the cycle does through `place_gangs`.
    """
    decisions = []
    for gang in gangs:
        held = state.held_by_row(gang.cached_bytes) if gang.cached_bytes else None
        tier: Sequence[Domain]
        if gang.topology == "node":
            # One domain per node, but only the nodes that pass _could_hold's test, found in one
            # vector operation instead of a trial per node (the same domains in the same order).
            # One-row domains made as they are tried: nothing per node of the cluster is made for a trial.
            tier = _OneNodeDomains(_rows_that_could_hold(state, gang))
            has_domains = state.n_nodes > 0
        else:
            tier = _domains(state, gang.topology)
            has_domains = bool(tier)
        # A preferred topology falls back to the whole cluster once no domain of it fits.
        fallback = _domains(state, "none") if not gang.required and gang.topology != "none" else []
        has_domains = has_domains or bool(fallback)
        last_pod = gang.pods[0].name
        if held is not None and gang.topology != "none" and len(tier) > 1 and all(pod.kind != "mig" for pod in gang.pods):
            placements, last_pod, applied = _place_preferring(
                state, gang, chooser, tier, seed, held, cache_tolerance_points, last_pod)
        else:
            placements, last_pod, applied = _first_fit(state, gang, chooser, tier, seed, held, cache_tolerance_points, last_pod)
        if placements is None and fallback:
            placements, last_pod, applied = _first_fit(
                state, gang, chooser, fallback, seed, held, cache_tolerance_points, last_pod)
        if placements is None:
            reason = _misfit_reason(gang, last_pod)
            if gang.topology != "none" and not has_domains:
                reason = f"it must run in {_ONE_DOMAIN[gang.topology]} but the cluster has none"
            decisions.append(GangDecision(gang.name, (), reason))
            continue
        if not applied:
            _apply(state, gang, placements)
        decisions.append(GangDecision(gang.name, tuple(placements)))
    return decisions


class _OneNodeDomains(Sequence):
    """One-node domains, one per row given, made as they are asked for."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows

    def __len__(self) -> int:
        return int(self.rows.size)

    def __getitem__(self, index: int) -> Domain:
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return _one_node(int(self.rows[index]))


_Tried = tuple[Optional[list[Placement]], str, bool]


def _fit(state: ClusterState, gang: Gang, chooser: Policy, domain: Domain, seed: int,
         held: Optional[np.ndarray], tolerance_points: float, keep: bool = True) -> _Tried:
    """`_try_domain`, preferring the nodes that hold the gang's data; tried again in the plain order when
    that finds no room, since sending an early pod to a cached node may take the room a later one needed:
    a gang that fits the domain without cached data fits it with."""
    tried = _try_domain(state, gang, chooser, domain, seed, held, tolerance_points, keep)
    if tried[0] is None and held is not None and len(gang.pods) > 1 and (domain.rows is None or domain.rows.size > 1):
        tried = _try_domain(state, gang, chooser, domain, seed, keep=keep)
    return tried


def _first_fit(state: ClusterState, gang: Gang, chooser: Policy, domains: Iterable[Domain], seed: int,
               held: Optional[np.ndarray], tolerance_points: float, last_pod: str) -> _Tried:
    """The gang in the first of the domains, in their order, that takes every pod."""
    for domain in domains:
        if not _could_hold(state, gang, domain):
            continue
        placements, last_pod, applied = _fit(state, gang, chooser, domain, seed, held, tolerance_points)
        if placements is not None:
            return placements, last_pod, applied
    return None, last_pod, False


def _domain_score(state: ClusterState, chooser: Policy, pod: PodRequest, domain: Domain) -> float:
    """The policy's best score for the pod on the domain's nodes (an NVLink domain's nodes whole)."""
    rows = domain.rows
    if rows is None and pod.kind in ("share", "whole"):
        rows = state.model_rows(pod)
    feasible = state.feasible(pod, domain.nodes, rows)
    return float(chooser.scores(state, pod, feasible).max()) if feasible.size else -np.inf


def _place_preferring(state: ClusterState, gang: Gang, chooser: Policy, tier: Sequence[Domain], seed: int,
                      held: np.ndarray, tolerance_points: float, last_pod: str) -> _Tried:
    """The gang in a domain of its topology that holds more of its bytes than the one the plain order
    takes, when one fits and is as good; else in that one.

    The plain order takes the first domain that fits. Another is as good when the policy's best
    score there for the gang's first pod is at least its best score in that first domain, less
    the tolerance. Domains holding more bytes (over their nodes) are tried first, most first.
    """
    first = None
    for index, domain in enumerate(tier):
        if not _could_hold(state, gang, domain):
            continue
        # Found on a trial that is undone: the gang is made where the search below ends.
        placements, last_pod, _ = _fit(state, gang, chooser, domain, seed, held, tolerance_points, keep=False)
        if placements is not None:
            first = index
            break
    if first is None:
        return None, last_pod, False
    if isinstance(tier, _OneNodeDomains):
        totals = held[tier.rows]
    else:
        totals = np.array([held[domain.mask(state.n_nodes)].sum() for domain in tier])
    richer = np.flatnonzero(totals > totals[first])
    if richer.size:
        pod = gang.pods[0]
        bar = _domain_score(state, chooser, pod, tier[first]) - tolerance_points
        for index in richer[np.argsort(-totals[richer], kind="stable")]:
            domain = tier[int(index)]
            if not _could_hold(state, gang, domain) or _domain_score(state, chooser, pod, domain) < bar:
                continue
            placements, _, applied = _fit(state, gang, chooser, domain, seed, held, tolerance_points)
            if placements is not None:
                return placements, last_pod, applied
    return _fit(state, gang, chooser, tier[first], seed, held, tolerance_points)


def place_pods(
    snapshot: Snapshot, pods: Iterable[PodRequest], policy: PolicyName = "portal", seed: int = 0
) -> list[GangDecision]:
    """Each pod as a gang of one, without topology constraint."""
    return place_gangs(snapshot, [Gang(pod.name, (pod,)) for pod in pods], policy=policy, seed=seed)
