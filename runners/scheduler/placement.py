"""Place gangs on a snapshot: all-or-nothing, inside the topology they ask for, MIG slices by NVIDIA's rules.

This is what the portal's scheduler cycle calls once admission has decided which gangs may run:
`place_gangs(snapshot, gangs)` returns one `GangDecision` per gang, in order, each either a
placement for every pod or a reason the gang waits. Earlier gangs' placements are taken into
account by later ones. Nothing here mutates the snapshot.

A gang is tried domain by domain (the whole cluster, each node, each NVLink domain or each rack),
its pods placed one after another on a scratch copy of the cluster (`ClusterState.copy`) with the
chosen policy; the first domain that takes every pod wins. A preferred constraint (`required`
False) falls back to the whole cluster when no domain fits; a required one makes the gang wait.
The policy is built once per call, so FGD's per-node scores carry over from domain to domain and
from gang to gang instead of being recomputed for every trial.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

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
    """One place a gang may go: its nodes, and its GPUs when it is narrower than whole nodes (NVLink)."""

    nodes: np.ndarray  # bool per node
    gpus: Optional[np.ndarray] = None  # bool per (node, GPU slot); None: every GPU of those nodes


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
        return [Domain(np.ones(state.n_nodes, dtype=bool))]
    if topology == "node":
        return [Domain(np.arange(state.n_nodes) == row) for row in range(state.n_nodes)]
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
    # memory slices (best fit), then the lowest start, which leaves the high slots contiguous.
    slot = min(
        slots,
        key=lambda s: (not s.reuses_idle, state.mig_free_slices(s.row, s.col), state.tie_rank[s.row], s.col, s.start),
    )
    state.place_mig(slot.row, slot.col, slot.start, pod)
    return Placement(pod.name, state.node_names[slot.row], (slot.col,), 0, pod.mig_profile, slot.start)


def _place_one(
    state: ClusterState, pod: PodRequest, policy: Policy, node_mask: np.ndarray, rng: np.random.Generator
) -> Optional[Placement]:
    if pod.kind == "mig":
        return _place_mig(state, pod, node_mask)
    feasible = state.feasible(pod, node_mask)
    if feasible.size == 0:
        return None
    row, gpus = policy.select(state, pod, feasible, rng)
    state.place(row, pod, gpus)
    return Placement(pod.name, state.node_names[row], tuple(gpus), pod.gpu_milli if gpus else 0)


def _could_hold(state: ClusterState, gang: Gang, node_mask: np.ndarray, gpu_mask: Optional[np.ndarray]) -> bool:
    """A cheap necessary condition, so that most domains are skipped without a trial placement."""
    if not node_mask.any():
        return False
    cpu = sum(pod.cpu_milli for pod in gang.pods)
    memory = sum(pod.memory_mib for pod in gang.pods)
    gpu_milli = sum(pod.total_gpu_milli for pod in gang.pods if pod.gpu_count)
    left = state.gpu_left_milli if gpu_mask is None else np.where(gpu_mask, state.gpu_left_milli, 0)
    return (
        state.cpu_left_milli[node_mask].sum() >= cpu
        and state.memory_left_mib[node_mask].sum() >= memory
        and left[node_mask].sum() >= gpu_milli
    )


def _rows_that_could_hold(state: ClusterState, gang: Gang) -> np.ndarray:
    """The nodes that, each on its own, pass `_could_hold` for the whole gang."""
    cpu = sum(pod.cpu_milli for pod in gang.pods)
    memory = sum(pod.memory_mib for pod in gang.pods)
    gpu_milli = sum(pod.total_gpu_milli for pod in gang.pods if pod.gpu_count)
    fits = (
        state.schedulable
        & (state.cpu_left_milli >= cpu)
        & (state.memory_left_mib >= memory)
        & (state.gpu_left_milli.sum(axis=1) >= gpu_milli)
    )
    return np.flatnonzero(fits)


def _try_domain(
    state: ClusterState, gang: Gang, policy: Policy, domain: Domain, seed: int
) -> tuple[Optional[list[Placement]], str]:
    """The gang's placements inside the domain, tried on a scratch copy; or None and the pod that did not fit."""
    scratch = state.copy()
    if domain.gpus is not None:
        scratch.hide_gpus_outside(domain.gpus)
    # Every trial draws from the same seed, so a gang's random-fit choices do not depend on how
    # many domains were tried before.
    rng = np.random.default_rng(seed)
    placements = []
    for pod in gang.pods:
        placement = _place_one(scratch, pod, policy, domain.nodes, rng)
        if placement is None:
            return None, pod.name
        placements.append(placement)
    return placements, ""


def _apply(state: ClusterState, gang: Gang, placements: list[Placement]) -> None:
    """Make a gang's placements, found on a scratch copy, on the cycle's state."""
    rows = {name: row for row, name in enumerate(state.node_names)}
    for pod, placement in zip(gang.pods, placements):
        row = rows[placement.node]
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
) -> list[GangDecision]:
    """Decide, gang by gang in the given order, where each gang's pods go or why it waits."""
    state = ClusterState(list(snapshot.nodes))
    if typical is None:
        # Without a workload history, the pods in this cycle are the best guess of what comes next.
        pods = [pod for gang in gangs for pod in gang.pods if pod.kind != "mig"]
        typical = typical_pods(pods or [PodRequest("cpu", 1000, 1024)], with_memory=policy == "portal")
    # One policy for the whole call: every trial state is a copy of `state`, so its caches hold.
    chooser = make_policy(policy, typical)
    decisions = []
    for gang in gangs:
        if gang.topology == "node":
            # One domain per node, but only the nodes that pass _could_hold's test, found in one
            # vector operation instead of a trial per node (the same domains in the same order).
            # A generator: the masks are made only for the nodes actually tried.
            domains = (Domain(np.arange(state.n_nodes) == row) for row in _rows_that_could_hold(state, gang))
            has_domains = state.n_nodes > 0
        else:
            domains = _domains(state, gang.topology)
            has_domains = bool(domains)
        if not gang.required and gang.topology != "none":
            domains = itertools.chain(domains, _domains(state, "none"))
            has_domains = True
        placements, last_pod = None, gang.pods[0].name
        for domain in domains:
            if not _could_hold(state, gang, domain.nodes & state.schedulable, domain.gpus):
                continue
            placements, last_pod = _try_domain(state, gang, chooser, domain, seed)
            if placements is not None:
                break
        if placements is None:
            reason = _misfit_reason(gang, last_pod)
            if gang.topology != "none" and not has_domains:
                reason = f"it must run in {_ONE_DOMAIN[gang.topology]} but the cluster has none"
            decisions.append(GangDecision(gang.name, (), reason))
            continue
        _apply(state, gang, placements)
        decisions.append(GangDecision(gang.name, tuple(placements)))
    return decisions


def place_pods(
    snapshot: Snapshot, pods: Iterable[PodRequest], policy: PolicyName = "portal", seed: int = 0
) -> list[GangDecision]:
    """Each pod as a gang of one, without topology constraint."""
    return place_gangs(snapshot, [Gang(pod.name, (pod,)) for pod in pods], policy=policy, seed=seed)
