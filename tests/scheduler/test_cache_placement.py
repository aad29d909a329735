"""Cache-aware placement: cached bytes only break ties between placements the policy finds as good.

Properties: without cached bytes nothing changes; a gang placed without them is placed with them
(never waiting for a cached node while another fits), in the same topology tier; every pod it
places scores, by the policy's own score, at least as well as where the plain placement puts it,
less the tolerance. Examples show each rule at work.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runners.scheduler.model import ClusterState, Gang, Gpu, MigInstance, Node, PodRequest, Snapshot
from runners.scheduler.placement import place_gangs
from runners.scheduler.policies import POLICY_NAMES, make_policy, typical_pods

pytestmark = pytest.mark.unit

PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCORED_POLICIES = [name for name in POLICY_NAMES if name != "random"]
TYPICAL_SEED = [PodRequest("typical-1", 4000, 16384, 1, 1000), PodRequest("typical-share", 2000, 8192, 1, 500)]


@st.composite
def clusters(draw):
    """Small busy clusters: nodes in two racks, GPUs of one model each (some shared, some MIG), CPU and memory in use."""
    nodes = []
    for index in range(draw(st.integers(1, 6))):
        model = draw(st.sampled_from(["A100-40GB", "H100-80GB", "T4"]))
        gpus = []
        for slot in range(draw(st.integers(0, 8))):
            if model == "A100-40GB" and draw(st.integers(0, 5)) == 0:
                gpus.append(Gpu(model, mig_instances=[]))
            else:
                free = draw(st.sampled_from([1000, 1000, 1000, 500, 250, 0]))
                gpus.append(Gpu(model, free_milli=free, nvlink_domain=f"nv{index}-{slot // 4}"))
        cpu = draw(st.sampled_from([16000, 64000, 96000]))
        memory = draw(st.sampled_from([65536, 262144]))
        nodes.append(Node(
            name=f"node-{index}", cpu_milli=cpu, memory_mib=memory, gpus=gpus, rack=f"rack-{index % 2}",
            cpu_used_milli=draw(st.sampled_from([0, 0, cpu // 4, cpu // 2])),
            memory_used_mib=draw(st.sampled_from([0, memory // 4])),
            schedulable=draw(st.booleans()) or index == 0,
        ))
    return Snapshot(tuple(nodes))


@st.composite
def pods(draw, name, mig=True):
    kinds = ["cpu", "share", "whole", "mig"] if mig else ["cpu", "share", "whole"]
    kind = draw(st.sampled_from(kinds))
    cpu = draw(st.sampled_from([1000, 4000, 16000]))
    memory = draw(st.sampled_from([1024, 16384, 65536]))
    if kind == "cpu":
        return PodRequest(name, cpu, memory)
    if kind == "share":
        return PodRequest(name, cpu, memory, 1, draw(st.sampled_from([250, 500])))
    if kind == "whole":
        return PodRequest(name, cpu, memory, draw(st.sampled_from([1, 2, 4])), 1000)
    return PodRequest(name, cpu, memory, mig_profile=draw(st.sampled_from(["1g.5gb", "2g.10gb", "3g.20gb"])))


@st.composite
def gangs(draw, topologies=("none", "node", "nvlink", "rack"), mig=True, max_pods=3):
    index = draw(st.integers(0, 99))
    members = tuple(draw(pods(f"g{index}-p{i}", mig)) for i in range(draw(st.integers(1, max_pods))))
    return Gang(f"g{index}", members, draw(st.sampled_from(topologies)), draw(st.booleans()))


@st.composite
def cached(draw, snapshot):
    """Bytes held on some of the snapshot's nodes (and on one it does not have)."""
    names = [node.name for node in snapshot.nodes]
    held = {name: draw(st.sampled_from([0, 1 << 30, 2 << 30, 8 << 30])) for name in names if draw(st.booleans())}
    held["elsewhere"] = 4 << 30
    return held


def _with(gang: Gang, cached_bytes) -> Gang:
    return Gang(gang.name, gang.pods, gang.topology, gang.required, cached_bytes=cached_bytes)


def _typical(gang_list):
    pods = [pod for gang in gang_list for pod in gang.pods if pod.kind != "mig"]
    return typical_pods(pods + TYPICAL_SEED, with_memory=True)


def _in_one_domain(snapshot, gang, decision) -> bool:
    nodes = {node.name: node for node in snapshot.nodes}
    if gang.topology == "node":
        return len({p.node for p in decision.placements}) == 1
    if gang.topology == "rack":
        return len({nodes[p.node].rack for p in decision.placements}) == 1
    if gang.topology == "nvlink":
        domains = {nodes[p.node].gpus[i].nvlink_domain for p in decision.placements for i in p.gpu_indices}
        return len(domains) <= 1 and None not in domains
    return True


# --- properties -------------------------------------------------------------------------------------


@PROPERTY
@given(clusters(), st.lists(gangs(), min_size=1, max_size=4), st.sampled_from(POLICY_NAMES), st.sampled_from([0, 1, 5]))
def test_without_cached_bytes_on_its_nodes_placement_is_what_it_was(snapshot, gang_list, policy, tolerance):
    typical = _typical(gang_list)
    plain = place_gangs(snapshot, gang_list, policy=policy, typical=typical)
    nowhere = [_with(gang, {"elsewhere": 1 << 30, "node-0": 0}) for gang in gang_list]
    assert place_gangs(snapshot, nowhere, policy=policy, typical=typical, cache_tolerance_points=tolerance) == plain


@PROPERTY
@given(clusters(), st.lists(gangs(topologies=("none", "node")), min_size=1, max_size=4), st.sampled_from(POLICY_NAMES),
       st.sampled_from([0, 1, 5]))
def test_the_same_bytes_on_every_node_change_nothing(snapshot, gang_list, policy, tolerance):
    typical = _typical(gang_list)
    plain = place_gangs(snapshot, gang_list, policy=policy, typical=typical)
    everywhere = [_with(gang, {node.name: 3 << 30 for node in snapshot.nodes}) for gang in gang_list]
    assert place_gangs(snapshot, everywhere, policy=policy, typical=typical, cache_tolerance_points=tolerance) == plain


@PROPERTY
@given(st.data(), clusters(), gangs(), st.sampled_from(POLICY_NAMES), st.sampled_from([0, 1, 5]))
def test_a_gang_that_fits_without_cached_bytes_fits_with_them_in_the_same_tier(data, snapshot, gang, policy, tolerance):
    typical = _typical([gang])
    (plain,) = place_gangs(snapshot, [gang], policy=policy, typical=typical)
    (aware,) = place_gangs(snapshot, [_with(gang, data.draw(cached(snapshot)))], policy=policy, typical=typical,
                           cache_tolerance_points=tolerance)
    if plain.placed:
        assert aware.placed, f"the plain placement fit ({plain.placements}) but the cache-aware one waits: {aware.reason}"
        if _in_one_domain(snapshot, gang, plain):
            assert _in_one_domain(snapshot, gang, aware), "the cache-aware placement left the gang's topology tier"


# A cached node below the best is seldom drawn beside a better one: more examples find it.
@settings(PROPERTY, max_examples=250)
@given(st.data(), clusters(), gangs(topologies=("none", "node", "rack"), mig=False), st.sampled_from(SCORED_POLICIES),
       st.sampled_from([0, 1, 5]))
def test_every_pod_scores_at_least_as_well_as_where_the_plain_placement_puts_it(data, snapshot, gang, policy, tolerance):
    """Pod by pod, each on the cluster as the earlier pods left it: the cache-aware node scores no
    less than the best node (topology none) or than the plain placement's node (a domain), less
    the tolerance, by the policy's own score."""
    typical = _typical([gang])
    (plain,) = place_gangs(snapshot, [gang], policy=policy, typical=typical)
    (aware,) = place_gangs(snapshot, [_with(gang, data.draw(cached(snapshot)))], policy=policy, typical=typical,
                           cache_tolerance_points=tolerance)
    if not aware.placed:
        return
    scorer = make_policy(policy, typical)
    state = ClusterState(list(snapshot.nodes))
    if gang.topology == "none":
        for pod, placement in zip(gang.pods, aware.placements):
            feasible = state.feasible(pod)
            scores = scorer.scores(state, pod, feasible)
            chosen = scores[list(feasible).index(state.row_of[placement.node])]
            assert chosen >= scores.max() - tolerance, f"{pod.name} went to {placement.node}, {scores.max() - chosen} points below the best"
            state.place(state.row_of[placement.node], pod, placement.gpu_indices)
    elif plain.placed and _in_one_domain(snapshot, gang, plain):
        first = gang.pods[0]

        def score_at(node_name):
            return scorer.scores(state, first, np.array([state.row_of[node_name]]))[0]

        if gang.topology == "node":
            assert score_at(aware.placements[0].node) >= score_at(plain.placements[0].node) - tolerance
        else:
            # A rack is as good when the first pod's best score among its nodes is: compare those.
            nodes = {node.name: node for node in snapshot.nodes}

            def best_in(rack):
                feasible = state.feasible(first, np.array([nodes[name].rack == rack for name in state.node_names]))
                return scorer.scores(state, first, feasible).max()

            assert best_in(nodes[aware.placements[0].node].rack) >= best_in(nodes[plain.placements[0].node].rack) - tolerance


# --- examples ---------------------------------------------------------------------------------------


def _h100(name, rack=None, cpu_used=0, memory=2097152, free=None):
    gpus = [Gpu("H100-80GB", free_milli=1000 if free is None or i < free else 0) for i in range(8)]
    return Node(name, 192000, memory, gpus, rack=rack, cpu_used_milli=cpu_used)


ONE_GPU = PodRequest("p", 16000, 131072, 1, 1000)


def test_among_equally_good_nodes_it_takes_the_one_holding_the_data():
    snapshot = Snapshot((_h100("a"), _h100("b"), _h100("c")))
    (plain,) = place_gangs(snapshot, [Gang("job", (ONE_GPU,))])
    (aware,) = place_gangs(snapshot, [Gang("job", (ONE_GPU,), cached_bytes={"c": 10 << 30, "b": 2 << 30})])
    assert plain.placements[0].node == "a"
    assert aware.placements[0].node == "c"


def test_it_does_not_take_a_worse_node_for_its_data():
    # "a" has 7 GPUs taken: one more fills it, which FGD scores well above opening the empty "b".
    snapshot = Snapshot((_h100("a", free=1), _h100("b")))
    typical = typical_pods([PodRequest("t", 16000, 131072, 8, 1000)] * 3 + [ONE_GPU], with_memory=True)
    (aware,) = place_gangs(snapshot, [Gang("job", (ONE_GPU,), cached_bytes={"b": 64 << 30})], typical=typical)
    assert aware.placements[0].node == "a"


def test_a_tolerance_lets_a_node_a_few_points_below_the_best_win_for_its_data():
    snapshot = Snapshot((_h100("a", free=1), _h100("b")))
    typical = typical_pods([PodRequest("t", 16000, 131072, 8, 1000)] * 3 + [ONE_GPU], with_memory=True)
    state = ClusterState(list(snapshot.nodes))
    scores = make_policy("portal", typical).scores(state, ONE_GPU, np.array([0, 1]))
    gap = float(scores[0] - scores[1])
    assert gap > 0
    gang = Gang("job", (ONE_GPU,), cached_bytes={"b": 64 << 30})
    (just_below,) = place_gangs(snapshot, [gang], typical=typical, cache_tolerance_points=gap - 1)
    (within,) = place_gangs(snapshot, [gang], typical=typical, cache_tolerance_points=gap)
    assert (just_below.placements[0].node, within.placements[0].node) == ("a", "b")


def test_a_job_never_waits_for_the_node_holding_its_data():
    snapshot = Snapshot((_h100("cached", free=0), _h100("free")))
    (decision,) = place_gangs(snapshot, [Gang("job", (ONE_GPU,), cached_bytes={"cached": 64 << 30})])
    assert decision.placed and decision.placements[0].node == "free"


def test_a_gang_whose_cached_choice_would_strand_a_later_pod_is_placed_as_without_cache():
    # Best-fit ignores memory, so both nodes score the same for the first pod; the data is on "roomy",
    # whose memory the second pod needs. Preferring "roomy" for the first pod would strand the second.
    small = Node("small", 64000, 50000, [Gpu("T4") for _ in range(4)])
    roomy = Node("roomy", 64000, 100000, [Gpu("T4") for _ in range(4)])
    gang = Gang("pair", (PodRequest("first", 1000, 50000, 1, 1000), PodRequest("second", 1000, 60000, 1, 1000)))
    snapshot = Snapshot((small, roomy))
    (plain,) = place_gangs(snapshot, [gang], policy="bestfit")
    (aware,) = place_gangs(snapshot, [_with(gang, {"roomy": 8 << 30})], policy="bestfit")
    assert [p.node for p in plain.placements] == ["small", "roomy"]
    assert aware.placements == plain.placements


def test_a_gang_preferring_one_node_takes_the_node_holding_its_data_when_it_is_as_good():
    snapshot = Snapshot((_h100("a"), _h100("b")))
    gang = Gang("pair", (PodRequest("r0", 16000, 131072, 2, 1000),) * 2, topology="node", required=False)
    (plain,) = place_gangs(snapshot, [gang])
    (aware,) = place_gangs(snapshot, [_with(gang, {"b": 16 << 30})])
    assert {p.node for p in plain.placements} == {"a"}
    assert {p.node for p in aware.placements} == {"b"}


def test_a_gang_preferring_one_node_keeps_the_better_node_over_its_data():
    # "a" is half full: two more 2-GPU replicas fill it, better than opening "b".
    snapshot = Snapshot((_h100("a", free=4), _h100("b")))
    typical = typical_pods([PodRequest("t", 16000, 131072, 8, 1000)] * 3, with_memory=True)
    gang = Gang("pair", (PodRequest("r0", 16000, 131072, 2, 1000),) * 2, topology="node")
    (aware,) = place_gangs(snapshot, [_with(gang, {"b": 16 << 30})], typical=typical)
    assert {p.node for p in aware.placements} == {"a"}


def test_a_rack_gang_goes_to_the_rack_holding_its_data():
    snapshot = Snapshot((_h100("a1", "rack-a"), _h100("a2", "rack-a"), _h100("b1", "rack-b"), _h100("b2", "rack-b")))
    gang = Gang("ring", (PodRequest("r", 16000, 131072, 8, 1000),) * 2, topology="rack")
    (aware,) = place_gangs(snapshot, [_with(gang, {"b1": 8 << 30, "b2": 8 << 30, "a1": 4 << 30})])
    assert {p.node for p in aware.placements} == {"b1", "b2"}


def test_a_mig_slice_goes_to_the_node_holding_the_data_among_equal_slots():
    def mig_node(name):
        return Node(name, 64000, 262144, [Gpu("A100-40GB", mig_instances=[MigInstance("3g.20gb", 0)])])

    pod = PodRequest("m", 1000, 1024, mig_profile="3g.20gb")
    snapshot = Snapshot((mig_node("a"), mig_node("b")))
    (plain,) = place_gangs(snapshot, [Gang("m", (pod,))])
    (aware,) = place_gangs(snapshot, [Gang("m", (pod,), cached_bytes={"b": 1 << 30})])
    assert (plain.placements[0].node, aware.placements[0].node) == ("a", "b")


def test_a_gang_keeps_its_cached_bytes_sorted_without_zeros_and_refuses_negative_ones():
    gang = Gang("g", (ONE_GPU,), cached_bytes={"b": 2, "a": 1, "c": 0})
    assert gang.cached_bytes == (("a", 1), ("b", 2))
    assert gang == Gang("g", (ONE_GPU,), cached_bytes=[("b", 2), ("a", 1)])
    assert hash(gang) == hash(Gang("g", (ONE_GPU,), cached_bytes=[("b", 2), ("a", 1)]))
    with pytest.raises(ValueError, match="cached_bytes of node 'a'"):
        Gang("g", (ONE_GPU,), cached_bytes={"a": -1})
    with pytest.raises(ValueError, match="more than once"):
        Gang("g", (ONE_GPU,), cached_bytes=[("a", 1), ("a", 2)])


def test_a_pod_released_gives_back_exactly_what_it_took():
    state = ClusterState([_h100("a"), Node("t", 64000, 262144, [Gpu("T4") for _ in range(4)])])
    before = {name: getattr(state, name).copy() for name in ("cpu_left_milli", "memory_left_mib", "gpu_left_milli",
                                                             "affinity_pods", "total_left_milli", "full_free_gpus")}
    whole, share = PodRequest("w", 16000, 131072, 2, 1000), PodRequest("s", 2000, 4096, 1, 250)
    state.place(0, whole, (3, 5))
    state.place(1, share, (2,))
    state.release(1, share, (2,))
    state.release(0, whole, (3, 5))
    for name, array in before.items():
        assert (getattr(state, name) == array).all(), name
    with pytest.raises(ValueError, match="was not placed"):
        state.release(0, whole, (3, 5))
