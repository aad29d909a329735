"""Place gangs on a snapshot: all-or-nothing, inside the topology they ask for, MIG slices by NVIDIA's rules.

This is what the portal's scheduler cycle calls once admission has decided which gangs may run:
`place_gangs(snapshot, gangs)` returns one `GangDecision` per gang, in order, each either a
placement for every pod or a reason the gang waits. Earlier gangs' placements are taken into
account by later ones. Nothing here mutates the snapshot.

A gang is tried domain by domain (the whole cluster, each node, each NVLink domain or each rack),
its pods placed one after another on a scratch copy of the cluster with the chosen policy; the
first domain that takes every pod wins. A `preferred` constraint falls back to the whole cluster
when no domain fits; a `required` one makes the gang wait.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import numpy as np

from . import mig
from .model import ClusterState, Gang, GangDecision, MigInstance, Placement, PodRequest, Snapshot
from .policies import Policy, TypicalPod, make_policy, typical_pods


def _copy_state(state: ClusterState) -> ClusterState:
    clone = object.__new__(ClusterState)
    for key, value in state.__dict__.items():
        if isinstance(value, np.ndarray):
            value = value.copy()
        elif key == "mig":
            value = {slot: [MigInstance(i.profile, i.start, i.pod) for i in instances] for slot, instances in value.items()}
        clone.__dict__[key] = value
    return clone


def _domains(state: ClusterState, topology: str) -> list[tuple[str, np.ndarray, Optional[np.ndarray]]]:
    """(label, node mask, GPU mask or None) for each place a gang with this topology may go."""
    everything = np.ones(state.n_nodes, dtype=bool)
    if topology == "none":
        return [("cluster", everything, None)]
    if topology == "node":
        return [(f"node {name}", np.arange(state.n_nodes) == row, None) for row, name in enumerate(state.node_names)]
    if topology == "rack":
        return [
            (f"rack {name}", state.rack_id == rack, None) for rack, name in enumerate(state.rack_names) if name is not None
        ]
    domains = []
    for domain, name in enumerate(state.nvlink_domain_names):
        gpus = state.gpu_nvlink == domain
        domains.append((f"NVLink domain {name}", gpus.any(axis=1), gpus))
    return domains


def _restricted(state: ClusterState, gpu_mask: Optional[np.ndarray]) -> ClusterState:
    """A scratch copy where GPUs outside the mask look fully taken."""
    scratch = _copy_state(state)
    if gpu_mask is not None:
        scratch.gpu_left_milli[~gpu_mask] = 0
        scratch.gpu_is_mig[~gpu_mask] = False
        scratch._refresh_summaries(np.arange(scratch.n_nodes))
    return scratch


def _mig_candidates(state: ClusterState, pod: PodRequest, node_mask: np.ndarray) -> list[tuple[int, int, int, bool]]:
    """(row, col, start, reuses_existing) for every MIG slot the pod could take now."""
    ok = state.schedulable & node_mask & (state.cpu_left_milli >= pod.cpu_milli) & (state.memory_left_mib >= pod.memory_mib)
    candidates = []
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
                candidates.append((row, col, instance.start, True))
        placed = [(i.profile, i.start) for i in instances]
        for start in mig.free_starts(model, placed, pod.mig_profile):
            candidates.append((row, col, start, False))
    return candidates


def _place_mig(state: ClusterState, pod: PodRequest, node_mask: np.ndarray) -> Optional[Placement]:
    candidates = _mig_candidates(state, pod, node_mask)
    if not candidates:
        return None
    # An idle existing instance first (no repartitioning), then the GPU with the fewest free
    # memory slices (best fit), then the lowest start, which leaves the high slots contiguous.
    def free_slots(row: int, col: int) -> int:
        profiles = mig.profiles_for(state.gpu_models[row][col])
        used = sum(profiles[i.profile].span for i in state.mig[(row, col)])
        return mig.MEMORY_SLICES - used

    row, col, start, reuse = min(candidates, key=lambda c: (not c[3], free_slots(c[0], c[1]), state.tie_rank[c[0]], c[1], c[2]))
    instances = state.mig[(row, col)]
    if reuse:
        instance = next(i for i in instances if i.profile == pod.mig_profile and i.start == start and i.pod is None)
        instance.pod = pod.name
    else:
        instances.append(MigInstance(pod.mig_profile, start, pod.name))
        model = state.gpu_models[row][col]
        # The layout must stay one NVIDIA accepts; free_starts guarantees it, this keeps it checked.
        mig.check_placement(model, [(i.profile, i.start) for i in instances])
    state.cpu_left_milli[row] -= pod.cpu_milli
    state.memory_left_mib[row] -= pod.memory_mib
    state.version[row] += 1
    return Placement(pod.name, state.node_names[row], (col,), 0, pod.mig_profile, start)


def _place_one(
    state: ClusterState, pod: PodRequest, policy: Policy, node_mask: np.ndarray, rng: np.random.Generator
) -> Optional[Placement]:
    if pod.mig_profile is not None:
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


def _try_domain(
    state: ClusterState, gang: Gang, policy_name: str, typical: list[TypicalPod], node_mask: np.ndarray,
    gpu_mask: Optional[np.ndarray], seed: int,
) -> tuple[Optional[list[Placement]], str]:
    scratch = _restricted(state, gpu_mask)
    policy = make_policy(policy_name, typical)
    rng = np.random.default_rng(seed)
    placements = []
    for pod in gang.pods:
        placement = _place_one(scratch, pod, policy, node_mask, rng)
        if placement is None:
            return None, pod.name
        placements.append(placement)
    return placements, ""


def _apply(state: ClusterState, gang: Gang, placements: list[Placement]) -> None:
    rows = {name: row for row, name in enumerate(state.node_names)}
    for pod, placement in zip(gang.pods, placements):
        row = rows[placement.node]
        if pod.mig_profile is not None:
            col = placement.gpu_indices[0]
            instances = state.mig[(row, col)]
            existing = [i for i in instances if i.profile == pod.mig_profile and i.start == placement.mig_start]
            if existing:
                existing[0].pod = pod.name
            else:
                instances.append(MigInstance(pod.mig_profile, placement.mig_start, pod.name))
            state.cpu_left_milli[row] -= pod.cpu_milli
            state.memory_left_mib[row] -= pod.memory_mib
            state.version[row] += 1
        else:
            state.place(row, pod, placement.gpu_indices)


def place_gangs(
    snapshot: Snapshot,
    gangs: Sequence[Gang],
    policy: str = "portal",
    typical: Optional[list[TypicalPod]] = None,
    seed: int = 0,
) -> list[GangDecision]:
    """Decide, gang by gang in the given order, where each gang's pods go or why it waits."""
    state = ClusterState(list(snapshot.nodes))
    if typical is None:
        # Without a workload history, the pods in this cycle are the best guess of what comes next.
        pods = [pod for gang in gangs for pod in gang.pods if pod.mig_profile is None]
        typical = typical_pods(pods or [PodRequest("cpu", 1000, 1024)], with_memory=policy == "portal")
    decisions = []
    for gang in gangs:
        domains = _domains(state, gang.topology)
        if not gang.required and gang.topology != "none":
            domains = domains + _domains(state, "none")
        placements, last_pod = None, gang.pods[0].name
        for label, node_mask, gpu_mask in domains:
            if not _could_hold(state, gang, node_mask & state.schedulable, gpu_mask):
                continue
            placements, last_pod = _try_domain(state, gang, policy, typical, node_mask, gpu_mask, seed)
            if placements is not None:
                break
        if placements is None:
            where = {"none": "the cluster", "node": "any one node", "rack": "any one rack", "nvlink": "any one NVLink domain"}
            reason = f"pod {last_pod} of gang {gang.name} does not fit in {where[gang.topology]} beside the rest of the gang"
            if gang.topology != "none" and not domains:
                reason = f"gang {gang.name} requires {gang.topology} topology but the cluster has no such domains"
            decisions.append(GangDecision(gang.name, (), reason))
            continue
        _apply(state, gang, placements)
        decisions.append(GangDecision(gang.name, tuple(placements)))
    return decisions


def place_pods(snapshot: Snapshot, pods: Iterable[PodRequest], policy: str = "portal", seed: int = 0) -> list[GangDecision]:
    """Each pod as a gang of one, without topology constraint."""
    return place_gangs(snapshot, [Gang(pod.name, (pod,)) for pod in pods], policy=policy, seed=seed)
