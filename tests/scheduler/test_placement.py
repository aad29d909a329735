"""Placement: capacity is never exceeded, gangs are whole, topology and MIG rules hold, seeds repeat."""

from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runners.nvidia import mig
from runners.scheduler.model import ClusterState, Gang, Gpu, MigInstance, Node, PodRequest, Snapshot
from runners.scheduler.placement import place_gangs, place_pods
from runners.scheduler.policies import POLICY_NAMES, FragModel, make_policy, typical_pods

pytestmark = pytest.mark.e2e

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def clusters(draw):
    """Small clusters: a few nodes in two racks, GPUs of one model each, some MIG-partitioned."""
    nodes = []
    for index in range(draw(st.integers(1, 5))):
        model = draw(st.sampled_from(["A100-40GB", "H100-80GB", "T4"]))
        gpus = []
        for slot in range(draw(st.integers(0, 8))):
            if model != "T4" and draw(st.integers(0, 4)) == 0:
                gpus.append(Gpu(model, mig_instances=[]))
            else:
                gpus.append(
                    Gpu(model, free_milli=draw(st.sampled_from([1000, 1000, 600, 250, 0])), nvlink_domain=f"nv{index}-{slot // 4}")
                )
        nodes.append(
            Node(
                name=f"node-{index}",
                cpu_milli=draw(st.sampled_from([8000, 32000, 96000])),
                memory_mib=draw(st.sampled_from([16384, 131072])),
                gpus=gpus,
                rack=f"rack-{index % 2}",
                schedulable=draw(st.booleans()) or index == 0,
            )
        )
    return Snapshot(tuple(nodes))


@st.composite
def pods(draw, name):
    """A CPU pod, a GPU share, whole GPUs, or a MIG slice."""
    kind = draw(st.sampled_from(["cpu", "share", "whole", "mig"]))
    cpu = draw(st.sampled_from([500, 2000, 8000, 30000]))
    memory = draw(st.sampled_from([512, 4096, 65536]))
    if kind == "cpu":
        return PodRequest(name, cpu, memory)
    if kind == "share":
        return PodRequest(name, cpu, memory, 1, draw(st.sampled_from([100, 250, 500, 900])))
    if kind == "whole":
        return PodRequest(name, cpu, memory, draw(st.sampled_from([1, 2, 4])), 1000)
    return PodRequest(name, cpu, memory, mig_profile=draw(st.sampled_from(["1g.10gb", "2g.20gb", "3g.40gb", "1g.5gb"])))


@st.composite
def gangs(draw):
    result = []
    for index in range(draw(st.integers(1, 5))):
        members = tuple(draw(pods(f"g{index}-p{i}")) for i in range(draw(st.integers(1, 4))))
        result.append(
            Gang(f"g{index}", members, draw(st.sampled_from(["none", "node", "nvlink", "rack"])), draw(st.booleans()))
        )
    return result


def _check_capacity(snapshot, decisions, gang_list):
    by_name = {node.name: node for node in snapshot.nodes}
    pods_by_name = {pod.name: pod for gang in gang_list for pod in gang.pods}
    cpu, memory, gpu = defaultdict(int), defaultdict(int), defaultdict(int)
    for decision in decisions:
        for placement in decision.placements:
            pod = pods_by_name[placement.pod]
            cpu[placement.node] += pod.cpu_milli
            memory[placement.node] += pod.memory_mib
            for index in placement.gpu_indices:
                if pod.mig_profile is None:
                    gpu[(placement.node, index)] += pod.gpu_milli
    for name, used in cpu.items():
        assert used <= by_name[name].cpu_milli - by_name[name].cpu_used_milli, f"CPU overcommitted on {name}"
    for name, used in memory.items():
        assert used <= by_name[name].memory_mib - by_name[name].memory_used_mib, f"memory overcommitted on {name}"
    for (name, index), used in gpu.items():
        node_gpu = by_name[name].gpus[index]
        assert node_gpu.mig_instances is None, f"a milli-GPU pod landed on MIG GPU {name}/{index}"
        assert used <= node_gpu.free_milli, f"GPU {name}/{index} overcommitted: {used} > {node_gpu.free_milli}"


@PROPERTY
@given(clusters(), gangs(), st.sampled_from(POLICY_NAMES))
def test_it_never_overcommits_a_gpu_cpu_or_memory(snapshot, gang_list, policy):
    decisions = place_gangs(snapshot, gang_list, policy=policy)
    _check_capacity(snapshot, decisions, gang_list)


@PROPERTY
@given(clusters(), gangs())
def test_a_gang_is_placed_whole_or_not_at_all(snapshot, gang_list):
    decisions = place_gangs(snapshot, gang_list)
    assert [d.gang for d in decisions] == [g.name for g in gang_list]
    for gang, decision in zip(gang_list, decisions):
        assert len(decision.placements) in (0, len(gang.pods))
        assert [p.pod for p in decision.placements] in ([], [pod.name for pod in gang.pods])
        assert decision.placed or decision.reason


@PROPERTY
@given(clusters(), gangs())
def test_a_required_topology_constraint_always_holds(snapshot, gang_list):
    nodes = {node.name: node for node in snapshot.nodes}
    for gang, decision in zip(gang_list, place_gangs(snapshot, gang_list)):
        if not decision.placed or not gang.required:
            continue
        if gang.topology == "node":
            assert len({p.node for p in decision.placements}) == 1
        elif gang.topology == "rack":
            assert len({nodes[p.node].rack for p in decision.placements}) == 1
        elif gang.topology == "nvlink":
            domains = {nodes[p.node].gpus[i].nvlink_domain for p in decision.placements for i in p.gpu_indices}
            assert len(domains) <= 1 and None not in domains


@PROPERTY
@given(clusters(), gangs())
def test_a_mig_placement_is_always_one_nvidia_allows(snapshot, gang_list):
    layouts = defaultdict(list)
    for decision in place_gangs(snapshot, gang_list):
        for placement in decision.placements:
            if placement.mig_profile is not None:
                layouts[(placement.node, placement.gpu_indices[0])].append((placement.mig_profile, placement.mig_start))
    nodes = {node.name: node for node in snapshot.nodes}
    for (name, index), placed in layouts.items():
        gpu = nodes[name].gpus[index]
        assert gpu.mig_instances is not None
        assert mig.valid_placement(gpu.model, placed), f"{placed} is not a valid MIG layout on {gpu.model}"


@PROPERTY
@given(clusters(), gangs(), st.sampled_from(POLICY_NAMES))
def test_the_same_seed_gives_the_same_result(snapshot, gang_list, policy):
    assert place_gangs(snapshot, gang_list, policy=policy, seed=7) == place_gangs(snapshot, gang_list, policy=policy, seed=7)


def _eight_gpu_node(name, rack=None, domain=None):
    return Node(name, 96000, 393216, [Gpu("A100-80GB", nvlink_domain=domain) for _ in range(8)], rack=rack)


def test_it_keeps_a_required_node_gang_waiting_rather_than_splitting_it():
    snapshot = Snapshot((_eight_gpu_node("a"), _eight_gpu_node("b")))
    gang = Gang("big", tuple(PodRequest(f"w{i}", 4000, 8192, 4, 1000) for i in range(3)), topology="node")
    (decision,) = place_gangs(snapshot, [gang])
    assert not decision.placed
    assert "one node" in decision.reason


def test_a_preferred_node_gang_spreads_when_no_node_can_hold_it():
    snapshot = Snapshot((_eight_gpu_node("a"), _eight_gpu_node("b")))
    gang = Gang("big", tuple(PodRequest(f"w{i}", 4000, 8192, 4, 1000) for i in range(3)), topology="node", required=False)
    (decision,) = place_gangs(snapshot, [gang])
    assert decision.placed and len({p.node for p in decision.placements}) == 2


def test_an_nvlink_gang_stays_inside_one_domain():
    node = Node("a", 96000, 393216, [Gpu("H100-80GB", nvlink_domain="left" if i < 4 else "right") for i in range(8)])
    busy = [PodRequest("x", 1000, 1024, 1, 1000)]
    gang = Gang("ring", tuple(PodRequest(f"r{i}", 1000, 1024, 1, 1000) for i in range(4)), topology="nvlink")
    decisions = place_gangs(Snapshot((node,)), [Gang("x", tuple(busy)), gang])
    gpus = {i for p in decisions[1].placements for i in p.gpu_indices}
    assert gpus <= {4, 5, 6, 7}, "the first domain has only three free GPUs, so the ring must use the other"


def test_a_mig_request_reuses_an_idle_instance_before_carving_a_new_one():
    gpu = Gpu("A100-40GB", mig_instances=[MigInstance("3g.20gb", 4), MigInstance("3g.20gb", 0, pod="other")])
    (decision,) = place_pods(Snapshot((Node("a", 8000, 16384, [gpu]),)), [PodRequest("m", 1000, 1024, mig_profile="3g.20gb")])
    assert decision.placements[0].mig_start == 4


def test_a_mig_request_waits_when_no_start_slot_is_free():
    gpu = Gpu("A100-40GB", mig_instances=[MigInstance("4g.20gb", 0, pod="x"), MigInstance("3g.20gb", 4, pod="y")])
    (decision,) = place_pods(Snapshot((Node("a", 8000, 16384, [gpu]),)), [PodRequest("m", 1000, 1024, mig_profile="1g.5gb")])
    assert not decision.placed


def test_mig_slices_placed_by_one_gang_are_taken_when_the_next_gang_looks():
    gpu = Gpu("A100-40GB", mig_instances=[])
    gangs = [Gang(f"g{i}", (PodRequest(f"m{i}", 1000, 1024, mig_profile="3g.20gb"),)) for i in range(3)]
    decisions = place_gangs(Snapshot((Node("a", 8000, 16384, [gpu]),)), gangs)
    assert [d.placements[0].mig_start if d.placed else None for d in decisions] == [0, 4, None]


def test_a_pod_request_says_what_kind_it_is():
    kinds = [
        PodRequest("c", 1000, 1024).kind,
        PodRequest("s", 1000, 1024, 1, 500).kind,
        PodRequest("w", 1000, 1024, 2, 1000).kind,
        PodRequest("m", 1000, 1024, mig_profile="1g.5gb").kind,
        PodRequest("no-share", 1000, 1024, 1, 0).kind,
    ]
    assert kinds == ["cpu", "share", "whole", "mig", "cpu"]


def test_it_refuses_a_negative_request_naming_the_field():
    with pytest.raises(ValueError, match="cpu_milli"):
        PodRequest("p", -1, 1)


def test_it_refuses_a_shared_gpu_across_several_gpus():
    with pytest.raises(ValueError, match="exactly one GPU"):
        PodRequest("p", 1, 1, 2, 500)


def test_an_unschedulable_node_gets_nothing():
    snapshot = Snapshot((Node("cordoned", 8000, 8192, [Gpu("T4")], schedulable=False),))
    (decision,) = place_pods(snapshot, [PodRequest("p", 1000, 1024, 1, 1000)])
    assert not decision.placed


def test_fgd_prefers_the_gpu_that_a_share_fills_exactly():
    node = Node("a", 64000, 262144, [Gpu("T4", free_milli=1000), Gpu("T4", free_milli=400)])
    typical = typical_pods([PodRequest("t", 1000, 1024, 1, 400)] * 3 + [PodRequest("u", 1000, 1024, 1, 1000)])
    state = ClusterState([node])
    policy = make_policy("fgd", typical)
    row, gpus = policy.select(state, PodRequest("p", 1000, 1024, 1, 400), np.array([0]), np.random.default_rng(0))
    assert gpus == (1,)


def test_fragmentation_counts_a_gpu_too_small_for_the_typical_pod():
    typical = typical_pods([PodRequest("t", 1000, 1024, 1, 500)])
    state = ClusterState([Node("a", 64000, 262144, [Gpu("T4", free_milli=300), Gpu("T4")])])
    assert FragModel(state, typical).total() == pytest.approx(300)


def test_portal_keeps_cpu_beside_free_gpus():
    # Two identical empty 8-GPU nodes, one already short of CPU: a CPU-heavy pod should go to the
    # other one, whose CPU then still matches its free GPUs.
    full = Node("short", 96000, 393216, [Gpu("G2") for _ in range(8)], cpu_used_milli=60000)
    roomy = Node("roomy", 96000, 393216, [Gpu("G2") for _ in range(8)])
    typical = typical_pods([PodRequest("t", 4000, 8192, 1, 1000)] * 4, with_memory=True)
    state = ClusterState([full, roomy])
    policy = make_policy("portal", typical)
    pod = PodRequest("cpu-heavy", 30000, 8192)
    row, _ = policy.select(state, pod, state.feasible(pod), np.random.default_rng(0))
    assert state.node_names[row] == "roomy"


def test_the_scheduler_package_does_not_import_django():
    import subprocess
    import sys

    code = "import sys, runners.scheduler.placement, runners.scheduler.replay; print('django' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
