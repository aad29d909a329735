"""Defragmentation by migration (`runners.scheduler.defrag`): the plan makes room, breaks nothing, moves each pod once."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runners.scheduler.defrag import Placements, Running, apply_plan, moves_allowed, plan_room
from runners.scheduler.model import GPU_MILLI, ClusterState, Gpu, Node, PodRequest

pytestmark = pytest.mark.unit


def _node(name, gpus=4, cpu=32_000, memory=65_536, model="A100"):
    return Node(name=name, cpu_milli=cpu, memory_mib=memory, gpus=[Gpu(model=model) for _ in range(gpus)])


def _pod(name, num_gpu=1, gpu_milli=GPU_MILLI, cpu=1000, memory=1024):
    return PodRequest(name=name, cpu_milli=cpu, memory_mib=memory, num_gpu=num_gpu, gpu_milli=gpu_milli)


def _placed(state, placements):
    running = []
    for key, (pod, row, gpus) in enumerate(placements):
        state.place(row, pod, gpus)
        running.append(Running(key, pod, row, gpus))
    return Placements(state, running)


def _occupancy(state):
    return {name: getattr(state, name).copy() for name in ClusterState._OCCUPANCY}


def test_two_one_gpu_pods_on_two_nodes_give_way_to_a_four_gpu_pod_with_one_move():
    state = ClusterState([_node("a"), _node("b")])
    running = _placed(state, [(_pod("one"), 0, (0,)), (_pod("two"), 1, (2,))])
    gang = _pod("gang", num_gpu=4)
    assert state.feasible(gang).size == 0
    before = _occupancy(state)
    plan = plan_room(state, gang, running)
    assert plan is not None and len(plan.moves) == 1
    # Nothing changed while planning.
    for name, array in _occupancy(state).items():
        assert np.array_equal(array, before[name]), name
    apply_plan(state, gang, plan, running, key="gang")
    assert len(plan.gpus) == 4
    assert (state.gpu_left_milli[plan.row] == 0).all()
    move = plan.moves[0]
    assert move.to_row != plan.row and move.running.row == plan.row
    assert state.gpu_left_milli.sum() == 8 * GPU_MILLI - 6 * GPU_MILLI


def test_a_pod_that_may_not_move_is_never_moved():
    state = ClusterState([_node("a"), _node("b")])
    running = _placed(state, [(_pod("one"), 0, (0,)), (_pod("two"), 1, (2,))])
    gang = _pod("gang", num_gpu=4)
    assert plan_room(state, gang, running, movable=lambda r: False) is None
    plan = plan_room(state, gang, running, movable=lambda r: r.pod.name == "two")
    assert plan is not None and [m.running.pod.name for m in plan.moves] == ["two"]


def test_no_plan_when_the_moved_pod_has_nowhere_to_go():
    state = ClusterState([_node("a", gpus=2), _node("b", gpus=2)])
    running = _placed(state, [(_pod("one"), 0, (0,)), (_pod("two"), 1, (0,)), (_pod("three"), 1, (1,))])
    # Node a has one GPU free and b none: a 2-GPU pod needs "one" gone, and it fits nowhere else.
    assert plan_room(state, _pod("pair", num_gpu=2), running) is None


def test_shares_move_into_slivers_so_a_whole_gpu_frees_up():
    state = ClusterState([_node("a", gpus=1), _node("b", gpus=1), _node("c", gpus=1)])
    running = _placed(state, [
        (_pod("big-a", gpu_milli=700), 0, (0,)),
        (_pod("big-b", gpu_milli=700), 1, (0,)),
        (_pod("small-1", gpu_milli=200), 2, (0,)),
        (_pod("small-2", gpu_milli=300), 2, (0,)),
    ])
    whole = _pod("whole")
    assert state.feasible(whole).size == 0
    plan = plan_room(state, whole, running)
    assert plan is not None and plan.row == 2 and len(plan.moves) == 2
    assert plan.moved_gpu_milli == 500
    assert plan_room(state, whole, running, max_moves=1) is None


def test_the_budget_allows_moves_per_pod_arrived_less_those_made_and_two_at_most():
    assert moves_allowed(0.02, 100, 0) == 2
    assert moves_allowed(0.02, 100, 1) == 1
    assert moves_allowed(0.02, 100, 2) == 0
    assert moves_allowed(0.02, 49, 0) == 0
    assert moves_allowed(0.5, 100, 0) == 2
    assert moves_allowed(0.0, 10_000, 0) == 0


def test_a_bad_move_limit_is_refused():
    state = ClusterState([_node("a")])
    with pytest.raises(ValueError, match="max_moves"):
        plan_room(state, _pod("x"), Placements(state), max_moves=0)


SHAPES = st.sampled_from([
    (1, 1000), (1, 1000), (2, 1000), (4, 1000), (1, 500), (1, 250), (1, 300), (1, 700), (0, 0),
])


@st.composite
def clusters(draw):
    nodes = [
        _node(f"n{i}", gpus=draw(st.integers(1, 4)), cpu=draw(st.sampled_from([4000, 8000, 32_000])),
              model=draw(st.sampled_from(["A100", "T4"])))
        for i in range(draw(st.integers(2, 5)))
    ]
    pods = []
    for i in range(draw(st.integers(0, 30))):
        num_gpu, milli = draw(SHAPES)
        pod = _pod(f"p{i}", num_gpu=num_gpu, gpu_milli=milli, cpu=draw(st.sampled_from([500, 1000, 4000])))
        pods.append(pod)
    num_gpu, milli = draw(SHAPES)
    waiting = _pod("waiting", num_gpu=num_gpu, gpu_milli=milli, cpu=draw(st.sampled_from([500, 1000, 4000])))
    pinned = draw(st.sets(st.integers(0, 29), max_size=6))
    return nodes, pods, waiting, set(range(30)) - pinned, draw(st.integers(1, 3))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_a_plan_never_breaks_capacity_loses_or_doubles_a_pod_or_moves_one_twice(case):
    _check(case)


def test_the_invariants_hold_over_many_plans_not_just_a_few():
    """The same checks on seeded random clusters, counting the plans, so the property is seen where plans exist."""
    rng = np.random.default_rng(7)
    shapes = [(1, 1000), (1, 1000), (2, 1000), (4, 1000), (1, 500), (1, 250), (1, 300), (1, 700), (0, 0)]
    plans = 0
    for _ in range(1500):
        nodes = [_node(f"n{i}", gpus=int(rng.integers(1, 5)), cpu=int(rng.choice([4000, 8000, 32_000])),
                       model=str(rng.choice(["A100", "T4"]))) for i in range(int(rng.integers(2, 6)))]
        pods = []
        for i in range(int(rng.integers(4, 30))):
            num_gpu, milli = shapes[int(rng.integers(len(shapes)))]
            pods.append(_pod(f"p{i}", num_gpu=num_gpu, gpu_milli=milli, cpu=int(rng.choice([500, 1000, 4000]))))
        num_gpu, milli = shapes[int(rng.integers(len(shapes) - 1))]
        waiting = _pod("waiting", num_gpu=num_gpu, gpu_milli=milli, cpu=int(rng.choice([500, 1000, 4000])))
        pinned = set(rng.choice(30, size=int(rng.integers(0, 4)), replace=False).tolist())
        plans += _check((nodes, pods, waiting, set(range(30)) - pinned, int(rng.integers(1, 4)))) is not None
    assert plans >= 80, plans


def _check(case):
    """Place the pods, plan for the waiting one, and check the plan's invariants; the plan or None."""
    nodes, pods, waiting, movable_keys, max_moves = case
    state = ClusterState(nodes)
    running = []
    for key, pod in enumerate(pods):
        feasible = state.feasible(pod)
        if feasible.size:
            row = int(feasible[key % feasible.size])
            gpus = state.default_gpus(row, pod)
            state.place(row, pod, gpus)
            running.append(Running(key, pod, row, gpus))
    if state.feasible(waiting).size:
        return None
    before = _occupancy(state)
    placed = Placements(state, running)
    plan = plan_room(state, waiting, placed, max_moves=max_moves, movable=lambda r: r.key in movable_keys)
    for name, array in _occupancy(state).items():
        assert np.array_equal(array, before[name]), name
    if plan is None:
        return None
    keys = [move.running.key for move in plan.moves]
    assert 1 <= len(keys) <= max_moves and len(set(keys)) == len(keys)
    assert all(key in movable_keys for key in keys)
    assert all(move.to_row != move.running.row and move.to_row != plan.row for move in plan.moves)
    apply_plan(state, waiting, plan, placed, key="waiting")
    # Every pod once, where the plan says, and the state is exactly what placing them there from
    # scratch gives: nothing over a node's CPU, memory or GPU milli, nothing left behind.
    moved = {move.running.key: move for move in plan.moves}
    final = [(r.pod, moved[r.key].to_row, moved[r.key].to_gpus) if r.key in moved else (r.pod, r.row, r.gpus) for r in running]
    final.append((waiting, plan.row, plan.gpus))
    # The books moved with the pods: the index holds each pod once, where it now runs.
    assert sorted((r.pod.name, r.row, r.gpus) for r in placed.by_key.values()) == sorted(
        (pod.name, row, tuple(gpus)) for pod, row, gpus in final)
    fresh_books = Placements(state, [Running(i, pod, row, tuple(gpus)) for i, (pod, row, gpus) in enumerate(final)])
    assert np.array_equal(fresh_books.pods_on, placed.pods_on)
    fresh = ClusterState(nodes)
    for pod, row, gpus in final:
        fresh.place(row, pod, gpus)
    for name in ("cpu_left_milli", "memory_left_mib", "gpu_left_milli"):
        assert np.array_equal(getattr(fresh, name), getattr(state, name)), name
    assert (state.cpu_left_milli >= 0).all() and (state.memory_left_mib >= 0).all()
    assert (state.gpu_left_milli >= 0).all() and (state.gpu_left_milli <= GPU_MILLI).all()
    # A whole-GPU pod holds whole GPUs of its own; the model rule holds for every pod.
    for pod, row, gpus in final:
        if pod.gpu_count:
            assert len(set(gpus)) == pod.gpu_count
            assert all(col < state.gpu_count[row] for col in gpus)
    return plan
