"""ClusterState: copies are independent, versions never repeat across copies, so policy caches can be shared."""

import numpy as np
import pytest

from runners.scheduler import placement
from runners.scheduler.model import ClusterState, Gang, Gpu, MigInstance, Node, PodRequest, Snapshot
from runners.scheduler.placement import place_gangs
from runners.scheduler.policies import FragModel, make_policy, typical_pods

pytestmark = pytest.mark.e2e


def _cluster():
    return ClusterState(
        [
            Node("a", 32000, 131072, [Gpu("T4", nvlink_domain="left"), Gpu("T4", nvlink_domain="right")], rack="r0"),
            Node("b", 32000, 131072, [Gpu("T4", free_milli=500), Gpu("T4")], rack="r0"),
            Node("c", 32000, 131072, [Gpu("A100-40GB", mig_instances=[MigInstance("3g.20gb", 4)])], rack="r1"),
            Node("d", 8000, 16384),
        ]
    )


def test_a_copy_owns_its_occupancy_and_shares_a_read_only_layout():
    state = _cluster()
    clone = state.copy()
    assert set(vars(clone)) == set(vars(state))
    for name, value in vars(state).items():
        if not isinstance(value, np.ndarray):
            continue
        if name in ClusterState._OCCUPANCY:
            assert not np.shares_memory(value, getattr(clone, name)), f"{name} is shared with the copy"
        else:
            # Anything a placement could change must be in _OCCUPANCY; the rest cannot be written.
            assert not value.flags.writeable, f"{name} is neither copied nor read-only"
    clone.place(0, PodRequest("p", 4000, 8192, 1, 1000), (0,))
    clone.place_mig(2, 0, 0, PodRequest("m", 1000, 1024, mig_profile="3g.20gb"))
    assert state.cpu_left_milli[0] == 32000 and state.gpu_left_milli[0, 0] == 1000
    assert state.mig_layout(2, 0) == [("3g.20gb", 4)] and state.mig[(2, 0)][0].pod is None
    assert clone.mig_layout(2, 0) == [("3g.20gb", 4), ("3g.20gb", 0)]


def test_sibling_copies_never_stamp_the_same_version():
    state = _cluster()
    left, right = state.copy(), state.copy()
    left.place(1, PodRequest("share", 1000, 1024, 1, 250), (0,))
    right.place(1, PodRequest("whole", 1000, 1024, 1, 1000), (1,))
    # Each node changed once in each copy, to different contents: the versions must differ too.
    assert left.version[1] != right.version[1]
    assert left.same_family(right) and not state.same_family(_cluster())


def test_hiding_gpus_restamps_only_the_nodes_it_changes():
    state = _cluster()
    before = state.version.copy()
    # Keep GPU 0 of node a; node b loses both GPUs, MIG node c its GPU, node d has none to lose.
    keep = np.zeros_like(state.gpu_left_milli, dtype=bool)
    keep[0, 0] = True
    state.hide_gpus_outside(keep)
    assert list(state.version != before) == [True, True, True, False]
    assert state.total_left_milli.tolist() == [1000, 0, 0, 0] and not state.gpu_is_mig.any()


def test_a_policy_reused_on_a_sibling_copy_scores_as_a_fresh_one_does():
    pods = [PodRequest("t", 2000, 4096, 1, 500), PodRequest("u", 4000, 8192, 1, 1000), PodRequest("c", 8000, 8192)]
    typical = typical_pods(pods, with_memory=True)
    state = _cluster()
    left, right = state.copy(), state.copy()
    left.place(1, PodRequest("x", 1000, 1024, 1, 500), (0,))
    right.place(1, PodRequest("y", 1000, 1024, 1, 500), (1,))
    reused = make_policy("portal", typical)
    for pod in pods:
        reused.select(left, pod, left.feasible(pod), np.random.default_rng(0))
    frag = reused.bind(right)
    assert frag.total() == pytest.approx(FragModel(right, typical).total())
    for pod in pods:
        fresh = make_policy("portal", typical)
        rng = np.random.default_rng(0)
        assert reused.select(right, pod, right.feasible(pod), rng) == fresh.select(right, pod, right.feasible(pod), rng)
        assert np.array_equal(
            reused._scores(right, pod, right.feasible(pod))[0], fresh._scores(right, pod, right.feasible(pod))[0]
        )


def test_a_frag_model_will_not_follow_a_state_of_another_family():
    typical = typical_pods([PodRequest("t", 1000, 1024, 1, 500)])
    with pytest.raises(ValueError, match="copies of the state"):
        FragModel(_cluster(), typical).follow(_cluster())


def test_place_gangs_builds_one_policy_and_one_fragmentation_model_per_call(monkeypatch):
    built = []
    original = FragModel.__init__

    def counting_init(self, state, typical):
        built.append(state)
        original(self, state, typical)

    monkeypatch.setattr(FragModel, "__init__", counting_init)
    policies = []
    monkeypatch.setattr(placement, "make_policy", lambda *args: policies.append(args) or make_policy(*args))
    nodes = tuple(Node(f"n{i}", 16000, 65536, [Gpu("T4", nvlink_domain=f"nv{i}") for _ in range(2)]) for i in range(6))
    gangs = [
        Gang(f"g{i}", (PodRequest(f"g{i}-a", 4000, 8192, 1, 1000), PodRequest(f"g{i}-b", 4000, 8192, 1, 500)), topology)
        for i, topology in enumerate(["node", "nvlink", "node", "none", "rack", "node"])
    ]
    decisions = place_gangs(Snapshot(nodes), gangs, policy="fgd")
    assert len(policies) == 1 and len(built) == 1
    assert [d.placed for d in decisions] == [True, True, True, True, False, True]


def test_no_module_of_the_scheduler_package_imports_django_or_a_portal_app():
    import subprocess
    import sys

    code = (
        "import importlib, pkgutil, sys, runners.scheduler as pkg\n"
        "for module in pkgutil.walk_packages(pkg.__path__, 'runners.scheduler.'):\n"
        "    importlib.import_module(module.name)\n"
        "apps = ('django', 'portal', 'tenants', 'quotas', 'frontend', 'common', 'runners.clusters', 'runners.environments', 'runners.jobs', 'runners.scheduling', 'runners.backends')\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] in apps or name.startswith(apps)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
