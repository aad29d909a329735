"""The replay in time (`runners.scheduler.departures`): a queue, departures, and moves that shorten a wait."""

import json

import numpy as np
import pytest

from runners.scheduler.departures import departures_replay, scaled_arrivals
from runners.scheduler.model import Gpu, Node, PodRequest
from runners.scheduler.openb import TracePod
from runners.scheduler.replay import main

pytestmark = pytest.mark.unit


def _nodes():
    return [Node(name=name, cpu_milli=64_000, memory_mib=262_144, gpus=[Gpu(model="G2") for _ in range(4)]) for name in "ab"]


def _pod(name, created, deleted, num_gpu=1):
    return TracePod(PodRequest(name=name, cpu_milli=1000, memory_mib=1024, num_gpu=num_gpu, gpu_milli=1000), "", created, deleted)


def _trace():
    # Eight 1-GPU pods fill both nodes; four of them (two on each node, as best-fit packs them) end at
    # t=10, leaving 2 + 2 GPUs free; a 4-GPU pod arrives at t=20 and, without a move, waits for t=1000.
    pods = [_pod(f"p{i}", i, 10 if i in (0, 1, 4, 5) else 1000) for i in range(8)]
    return pods + [_pod("gang", 20, 120, num_gpu=4)]


def test_a_gang_that_fits_nowhere_waits_for_departures_without_moves_and_starts_at_once_with_them():
    waited = departures_replay(_nodes(), _trace(), "bestfit", 0)
    assert waited.pods_started == 9 and waited.pods_never_started == 0
    assert waited.moves == 0
    assert waited.wait_p99_s > 900  # the gang waited from t=20 to t=1000
    moved = departures_replay(_nodes(), _trace(), "bestfit", 0, defrag=True, defrag_budget=1.0, move_cost_s=60)
    assert moved.wait_p99_s == 0 and moved.wait_mean_s == 0
    assert moved.moves == 2 and moved.gpu_seconds_lost_to_moves == 120
    # The moved pods finish a minute later than they would have: the replay ends then, not at 1000.
    assert moved.span_s == 1060


def test_random_traces_with_moves_start_every_pod_once_and_leave_the_cluster_empty():
    """Seeded random lists with a generous budget: the replay's own end check (nothing still held) holds,
    every pod starts, and the moves stay within the budget."""
    rng = np.random.default_rng(11)
    shapes = [(1, 1000), (2, 1000), (4, 1000), (1, 500), (1, 300), (1, 700), (0, 0)]
    moved = 0
    for case in range(60):
        pods = []
        for i in range(int(rng.integers(10, 40))):
            num_gpu, milli = shapes[int(rng.integers(len(shapes)))]
            created = int(rng.integers(0, 50))
            pods.append(TracePod(PodRequest(name=f"c{case}-{i}", cpu_milli=int(rng.choice([500, 4000, 16_000])),
                                            memory_mib=1024, num_gpu=num_gpu, gpu_milli=milli),
                                 "", created, created + int(rng.integers(1, 200))))
        result = departures_replay(_nodes(), pods, "portal", case, defrag=True, defrag_budget=0.5, move_cost_s=5)
        assert result.pods_started + result.pods_never_started == result.pods == len(pods) - result.pods_unplaceable
        assert result.pods_never_started == 0
        assert result.moves <= 0.5 * result.pods
        moved += result.moves
    assert moved > 0


def test_no_budget_means_no_moves():
    result = departures_replay(_nodes(), _trace(), "bestfit", 0, defrag=True, defrag_budget=0.0)
    assert result.moves == 0 and result.wait_p99_s > 900


def test_a_pod_too_big_for_the_empty_cluster_is_counted_apart_and_waits_for_nothing():
    pods = [_pod("small", 0, 100), _pod("huge", 1, 50, num_gpu=8), _pod("late", 2, 80, num_gpu=4)]
    result = departures_replay(_nodes(), pods, "portal", 0)
    assert result.pods_unplaceable == 1 and result.pods == 2
    assert result.pods_started == 2 and result.pods_never_started == 0
    assert result.wait_p99_s == 0


def test_a_node_list_without_gpus_is_refused():
    nodes = [Node(name="cpu-only", cpu_milli=64_000, memory_mib=262_144)]
    with pytest.raises(ValueError, match="1 node\\(s\\) but no GPUs"):
        departures_replay(nodes, _trace(), "portal", 0)


def test_a_pod_list_without_times_is_refused_naming_them():
    pods = [TracePod(PodRequest(name="x", cpu_milli=1, memory_mib=1, num_gpu=1, gpu_milli=1000), "")]
    with pytest.raises(ValueError, match="creation_time and deletion_time"):
        departures_replay(_nodes(), pods, "portal", 0)


@pytest.mark.parametrize(("setting", "value"), [
    ("arrive_within", -1.0), ("arrive_within", 1e400), ("arrive_within", float("nan")), ("tune", -0.5), ("tune", 1e9),
])
def test_an_absurd_setting_is_refused_naming_it(setting, value):
    with pytest.raises(ValueError, match=f"--{setting.replace('_', '-')}"):
        departures_replay(_nodes(), _trace(), "portal", 0, **{setting: value})


def test_arrivals_are_compressed_linearly_into_the_window():
    created = np.array([100.0, 600.0, 1100.0])
    assert scaled_arrivals(created, 200.0).tolist() == [0.0, 100.0, 200.0]
    assert scaled_arrivals(created, None).tolist() == [0.0, 500.0, 1000.0]


def test_everything_arriving_at_once_queues_what_does_not_fit_until_pods_leave():
    # Eight 1-GPU pods of 100 s and four more, all at t=0: the last four wait 100 s.
    pods = [_pod(f"p{i}", i, i + 100) for i in range(12)]
    result = departures_replay(_nodes(), pods, "portal", 0, arrive_within=0.0)
    assert result.pods_started == 12 and result.wait_p99_s == pytest.approx(100, abs=0.5)
    assert result.wait_mean_s == pytest.approx(4 * 100 / 12, abs=0.5)
    # Allocation averaged until the last start (t=100): full throughout.
    assert result.allocation_mean_pct == 100.0


NODES_CSV = "sn,cpu_milli,memory_mib,gpu,model\na,64000,262144,4,G2\nb,64000,262144,4,G2\n"
TIMED_CSV = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,creation_time,deletion_time\n" + "".join(
    f"{pod.request.name},1000,1024,{pod.request.num_gpu},1000,{pod.created_s},{pod.deleted_s}\n" for pod in _trace()
)
UNTIMED_CSV = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,1,1000\n"


@pytest.fixture
def files(tmp_path):
    for name, text in (("nodes.csv", NODES_CSV), ("timed.csv", TIMED_CSV), ("untimed.csv", UNTIMED_CSV)):
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(("extra", "words"), [
    (["--defrag", "--defrag-budget", "-0.5"], "--defrag-budget"),
    (["--defrag", "--defrag-budget", "7"], "--defrag-budget"),
    (["--defrag", "--defrag-budget", "nan"], "--defrag-budget"),
    (["--defrag", "--move-cost-s", "-1"], "--move-cost-s"),
    (["--defrag-budget", "0.1"], "need --defrag"),
    (["--arrive-within", "60"], "--arrive-within needs --departures"),
    (["--departures", "--arrive-within", "-5"], "--arrive-within"),
    (["--departures", "--window", "8"], "leave out --window"),
    (["--defrag", "--window", "8"], "window of 1"),
])
def test_bad_settings_are_one_line_and_exit_2(files, capsys, extra, words):
    with pytest.raises(SystemExit) as stopped:
        main(["--nodes", str(files / "nodes.csv"), "--pods", str(files / "timed.csv"), "--policy", "portal",
              "--seed", "1", "--tune", "0", *extra])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err


def test_the_departures_replay_of_a_list_without_times_is_one_line_and_exit_2(files, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--nodes", str(files / "nodes.csv"), "--pods", str(files / "untimed.csv"), "--policy", "fgd",
              "--seed", "1", "--departures"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "creation_time and deletion_time" in err and err.count("\n") == 1, err


def test_the_command_line_replays_in_time_with_moves(files, capsys):
    args = ["--nodes", str(files / "nodes.csv"), "--pods", str(files / "timed.csv"), "--policy", "bestfit", "--seed", "0",
            "--tune", "0", "--departures", "--json"]
    assert main(args + ["--defrag", "--defrag-budget", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["moves"] == 2 and out["wait_p99_s"] == 0 and out["pods_started"] == 9
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["wait_p99_s"] > 900
