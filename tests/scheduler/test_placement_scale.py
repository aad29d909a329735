"""The cycle at scale: placement tries a gang in place and undoes it, one-node domains are rows, and
admission keeps one line per tenant. Each gives the decisions the plain way gave, which these tests
keep here as references: a trial on a copy of the cluster per domain with a mask over every node,
and the smallest order key over every candidate gang after each decision."""

import heapq
import random
from collections import defaultdict

import numpy as np
import pytest

from runners.scheduler import placement
from runners.scheduler.admission import cycle as admission_cycle
from runners.scheduler.admission import decide
from runners.scheduler.admission.types import AdmissionSnapshot, FlavorQuota, PendingGang, RunningWorkload, TenantQuota
from runners.scheduler.model import (
    ClusterState,
    Gang,
    GangDecision,
    Gpu,
    MigInstance,
    Node,
    Placement,
    PodRequest,
    Snapshot,
)
from runners.scheduler.placement import place_gangs
from runners.scheduler.policies import make_policy, typical_pods

pytestmark = pytest.mark.unit

# --- Random clusters and gangs, larger than the property tests' -----------------------------------


def _cluster(rng: random.Random, nodes: int) -> Snapshot:
    made = []
    for index in range(nodes):
        model = rng.choice(["A100-40GB", "H100-80GB", "T4"])
        gpus = []
        for slot in range(rng.choice([0, 2, 4, 8, 8])):
            if model != "T4" and rng.randint(0, 5) == 0:
                gpus.append(Gpu(model, mig_instances=[MigInstance("1g.10gb", 0)] if model == "H100-80GB" else []))
            else:
                gpus.append(Gpu(model, free_milli=rng.choice([1000, 1000, 1000, 600, 250, 0]),
                                nvlink_domain=rng.choice([None, f"nv{index}-{slot // 4}"])))
        made.append(Node(
            name=f"node-{index:04d}", cpu_milli=rng.choice([8000, 32000, 96000]), memory_mib=rng.choice([16384, 131072]),
            gpus=gpus, rack=rng.choice([None, f"rack-{index % 4}"]), schedulable=rng.random() < 0.9 or index == 0,
            cpu_used_milli=rng.choice([0, 0, 4000]),
        ))
    return Snapshot(tuple(made))


def _gangs(rng: random.Random, count: int, topologies=("none", "node", "node", "nvlink", "rack")) -> list[Gang]:
    gangs = []
    for number in range(count):
        pods = []
        for rank in range(rng.randint(1, 4)):
            name, kind = f"g{number}-{rank}", rng.choice(["cpu", "share", "whole", "whole", "whole", "mig"])
            cpu, memory = rng.choice([500, 2000, 8000]), rng.choice([512, 4096, 32768])
            models = rng.choice([None, frozenset({"T4"}), frozenset({"A100-40GB", "H100-80GB"})])
            if kind == "cpu":
                pods.append(PodRequest(name, cpu, memory))
            elif kind == "share":
                pods.append(PodRequest(name, cpu, memory, 1, rng.choice([250, 500, 900]), gpu_models=models))
            elif kind == "whole":
                pods.append(PodRequest(name, cpu, memory, rng.choice([1, 2, 4]), 1000, gpu_models=models))
            else:
                pods.append(PodRequest(name, cpu, memory, mig_profile=rng.choice(["1g.10gb", "2g.20gb", "1g.5gb"])))
        gangs.append(Gang(f"g{number}", tuple(pods), rng.choice(topologies), rng.random() < 0.7))
    return gangs


# --- Placement: the reference, a copy per trial and a mask per node -------------------------------


def _reference_place_gangs(snapshot: Snapshot, gangs: list[Gang], policy: str, seed: int) -> list[GangDecision]:
    state = ClusterState(list(snapshot.nodes))
    pods = [pod for gang in gangs for pod in gang.pods if pod.kind != "mig"]
    chooser = make_policy(policy, typical_pods(pods or [PodRequest("cpu", 1000, 1024)], with_memory=policy == "portal"))
    everywhere = (np.ones(state.n_nodes, dtype=bool), None)

    def domains(topology):
        if topology == "none":
            return [everywhere]
        if topology == "node":
            return [(np.arange(state.n_nodes) == row, None) for row in range(state.n_nodes)]
        if topology == "rack":
            return [(state.rack_id == rack, None) for rack, name in enumerate(state.rack_names) if name is not None]
        found = []
        for domain in range(len(state.nvlink_domain_names)):
            gpus = state.gpu_nvlink == domain
            found.append((gpus.any(axis=1), gpus))
        return found

    def could_hold(gang, nodes, gpus):
        nodes = nodes & state.schedulable
        if not nodes.any():
            return False
        left = state.gpu_left_milli if gpus is None else np.where(gpus, state.gpu_left_milli, 0)
        return (state.cpu_left_milli[nodes].sum() >= sum(pod.cpu_milli for pod in gang.pods)
                and state.memory_left_mib[nodes].sum() >= sum(pod.memory_mib for pod in gang.pods)
                and left[nodes].sum() >= sum(pod.total_gpu_milli for pod in gang.pods if pod.gpu_count))

    decisions = []
    for gang in gangs:
        tried = domains(gang.topology)
        has_domains = bool(tried)
        if not gang.required and gang.topology != "none":
            tried, has_domains = tried + [everywhere], True
        found, last_pod = None, gang.pods[0].name
        for nodes, gpus in tried:
            if not could_hold(gang, nodes, gpus):
                continue
            scratch = state.copy()
            if gpus is not None:
                scratch.hide_gpus_outside(gpus)
            generator, found = np.random.default_rng(seed), []
            for pod in gang.pods:
                if pod.kind == "mig":
                    made = placement._place_mig(scratch, pod, nodes)
                else:
                    feasible = scratch.feasible(pod, nodes)
                    made = None
                    if feasible.size:
                        row, gpu_indices = chooser.select(scratch, pod, feasible, generator)
                        scratch.place(row, pod, gpu_indices)
                        made = Placement(pod.name, scratch.node_names[row], tuple(gpu_indices),
                                         pod.gpu_milli if gpu_indices else 0)
                if made is None:
                    found, last_pod = None, pod.name
                    break
                found.append(made)
            if found is not None:
                break
        if found is None:
            reason = placement._misfit_reason(gang, last_pod)
            if gang.topology != "none" and not has_domains:
                reason = f"it must run in {placement._ONE_DOMAIN[gang.topology]} but the cluster has none"
            decisions.append(GangDecision(gang.name, (), reason))
            continue
        rows = {name: row for row, name in enumerate(state.node_names)}
        for pod, made in zip(gang.pods, found):
            if pod.kind == "mig":
                state.place_mig(rows[made.node], made.gpu_indices[0], made.mig_start, pod)
            else:
                state.place(rows[made.node], pod, made.gpu_indices)
        decisions.append(GangDecision(gang.name, tuple(found)))
    return decisions


@pytest.mark.parametrize("policy", ["portal", "fgd", "bestfit", "random"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_trying_gangs_in_place_decides_as_trying_them_on_copies(policy, seed):
    rng = random.Random(seed)
    snapshot, gangs = _cluster(rng, 150), _gangs(rng, 120)
    decided = place_gangs(snapshot, gangs, policy=policy, seed=seed)
    assert decided == _reference_place_gangs(snapshot, gangs, policy, seed)
    assert sum(decision.placed for decision in decided) > 20, "the scenario places enough to compare"
    assert any(not decision.placed for decision in decided), "and leaves some waiting"


def test_node_topology_on_a_large_cluster_makes_no_copy_and_no_mask_per_node(monkeypatch):
    rng = random.Random(7)
    snapshot, gangs = _cluster(rng, 2000), _gangs(rng, 300, topologies=("node",))
    copies, masks = [], []
    real_copy, real_domain = ClusterState.copy, placement.Domain.mask
    monkeypatch.setattr(ClusterState, "copy", lambda self: copies.append(1) or real_copy(self))
    monkeypatch.setattr(placement.Domain, "mask", lambda self, n: masks.append(self) or real_domain(self, n))
    gangs = [gang for gang in gangs if all(pod.kind != "mig" for pod in gang.pods)]
    decided = place_gangs(snapshot, gangs, seed=7)
    assert copies == [] and masks == [], "a one-node trial costs that node, not the cluster"
    monkeypatch.undo()
    assert decided == _reference_place_gangs(snapshot, gangs, "portal", 7)
    assert sum(decision.placed for decision in decided) > 100


def test_a_trial_undone_leaves_every_node_as_it_was_versions_and_mig_layouts_included():
    rng = random.Random(3)
    state = ClusterState(list(_cluster(rng, 40).nodes))
    before = state.copy()
    state.trial()
    whole = PodRequest("w", 1000, 1024, 2, 1000)
    share = PodRequest("s", 1000, 1024, 1, 250)
    placed = 0
    for pod in (whole, share, whole):
        feasible = state.feasible(pod)
        if feasible.size:
            row = int(feasible[0])
            state.place(row, pod, state.default_gpus(row, pod))
            placed += 1
    mig_pod = PodRequest("m", 500, 512, mig_profile="1g.10gb")
    slots = placement._mig_slots(state, mig_pod, np.ones(state.n_nodes, dtype=bool))
    assert slots, "the cluster has a MIG GPU to take a slice of"
    slot = slots[0]
    state.place_mig(slot.row, slot.col, slot.start, mig_pod)
    assert placed == 3 and not np.array_equal(state.version, before.version)
    state.undo()
    for name in ClusterState._OCCUPANCY:
        assert np.array_equal(getattr(state, name), getattr(before, name)), name
    assert {slot: state.mig_layout(*slot) for slot in state.mig} == {slot: before.mig_layout(*slot) for slot in before.mig}
    assert all(instance.pod is None or instance.pod != "m" for instances in state.mig.values() for instance in instances)


def test_feasible_on_rows_answers_as_the_mask_of_those_rows():
    rng = random.Random(5)
    state = ClusterState(list(_cluster(rng, 200).nodes))
    for pod in (PodRequest("w", 8000, 4096, 2, 1000, gpu_models=frozenset({"T4"})), PodRequest("s", 500, 512, 1, 250),
                PodRequest("c", 2000, 512)):
        rows = np.array(sorted(rng.sample(range(state.n_nodes), 60)))
        mask = np.zeros(state.n_nodes, dtype=bool)
        mask[rows] = True
        assert np.array_equal(state.feasible(pod, rows=rows), state.feasible(pod, mask))
        if pod.gpu_count:
            assert np.array_equal(state.feasible(pod, rows=state.model_rows(pod)), state.feasible(pod))


# --- Admission: the reference, the smallest key over every candidate after each decision ---------


class _EveryCandidate(admission_cycle._Cycle):
    """decide as it was: a heap of every candidate gang, an entry re-keyed when its tenant moved."""

    def run(self):
        candidates = [gang for gang in self.pending if not self._blocked_for_good(gang)]
        version: dict[str, int] = defaultdict(int)
        heap = [(self._order_key(gang), 0, index, gang) for index, gang in enumerate(candidates)]
        heapq.heapify(heap)
        while heap:
            key, seen, index, gang = heapq.heappop(heap)
            if seen != version[gang.tenant]:
                heapq.heappush(heap, (self._order_key(gang), version[gang.tenant], index, gang))
                continue
            self._decide_one(gang)
            version[gang.tenant] += 1
        self.pending = []  # all decided: the run below only builds the decisions
        return super().run()


@pytest.mark.parametrize("seed", [11, 12, 13, 14])
def test_admission_decides_as_the_smallest_key_over_every_candidate(seed):
    rng = random.Random(seed)
    flavors = {"H100": 64, "A100": 32, "T4": 16}
    tenants = [f"team-{index}" for index in range(6)]
    quotas = tuple(
        TenantQuota(name, {flavor: FlavorQuota(capacity // 8, capacity // rng.choice([2, 3, 4]), max_priority=rng.choice([5, 20]))
                           for flavor, capacity in flavors.items()}, weight=rng.choice([1.0, 2.0]), max_priority=20)
        for name in tenants
    )
    running = tuple(
        RunningWorkload(f"r{index}", rng.choice(tenants), {rng.choice(list(flavors)): rng.choice([1, 2, 4])},
                        priority=rng.randint(0, 10), started_at_s=rng.uniform(0, 900), estimated_runtime_s=rng.choice([None, 600.0]),
                        preemptible=rng.random() < 0.8)
        for index in range(30)
    )
    pending = tuple(
        PendingGang(f"p{index:04d}", rng.choice(tenants), {rng.choice(list(flavors)): rng.choice([1, 1, 2, 4, 8])},
                    priority=rng.randint(0, 25), submitted_at_s=rng.uniform(0, 1000),
                    estimated_runtime_s=rng.choice([None, 300.0, 3600.0]), preemptible=rng.random() < 0.85)
        for index in range(400)
    )
    snapshot = AdmissionSnapshot(flavors, quotas, running, pending)
    decided = decide(snapshot, 1000.0)
    reference = _EveryCandidate(snapshot, 1000.0, admission_cycle.DEFAULT_GRACE_PERIOD_S, 1).run()
    assert decided == reference
    assert decided.admitted and decided.waiting and decided.reservations
