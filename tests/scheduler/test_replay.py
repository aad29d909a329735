"""Trace replay: the published procedure, its output, its speed-independent figures, and bad input."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runners.scheduler.openb import TraceError, inflate, load_nodes, load_pods
from runners.scheduler.replay import replay

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
# The part of Alibaba's openb trace these tests replay, shipped in the repository (see its README).
OPENB = REPO / "tests" / "data" / "openb"

NODES_CSV = "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(
    f"n{i},{32000 if i % 2 else 96000},{131072},{2 if i % 2 else 8},{'T4' if i % 2 else 'G2'}\n" for i in range(12)
)
PODS_CSV = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n" + "".join(
    f"p{i:03d},{[2000, 4000, 8000][i % 3]},{4096},{[0, 1, 1, 1, 2, 8][i % 6]},{[0, 500, 1000, 250, 1000, 1000][i % 6]},"
    f"{'T4' if i % 7 == 0 and i % 6 in (1, 3) else ''}\n"
    for i in range(60)
)


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "runners.scheduler.replay", *map(str, args)], capture_output=True, text=True, cwd=REPO
    )


@pytest.fixture
def small_trace(tmp_path):
    return _write(tmp_path, "nodes.csv", NODES_CSV), _write(tmp_path, "pods.csv", PODS_CSV)


def test_json_output_has_every_field_and_131_points(small_trace):
    nodes, pods = small_trace
    result = _run("--nodes", nodes, "--pods", pods, "--policy", "portal", "--seed", 1, "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    for key in ("policy", "trace", "seed", "total_gpus", "pods_arrived", "pods_placed", "pods_failed", "elapsed_s", "pods_per_s"):
        assert key in out
    assert len(out["allocation_pct_by_arrived"]) == 131 and len(out["fragmentation_pct_by_arrived"]) == 131
    assert out["pods_placed"] + out["pods_failed"] == out["pods_arrived"]
    assert out["total_gpus"] == 6 * 2 + 6 * 8


def test_without_json_it_prints_one_summary_line(small_trace):
    nodes, pods = small_trace
    result = _run("--nodes", nodes, "--pods", pods, "--policy", "bestfit", "--seed", 3)
    assert result.returncode == 0 and len(result.stdout.strip().splitlines()) == 1
    assert "bestfit" in result.stdout and "pods placed" in result.stdout


def test_inflation_reaches_the_target_without_passing_it():
    pods = load_pods(OPENB / "openb_pod_list_default.csv")
    workload = inflate(pods, 6212, 1.3, np.random.default_rng(42))
    requested = sum(p.request.total_gpu_milli for p in workload)
    assert 1.29 * 6212 * 1000 < requested <= 1.3 * 6212 * 1000 + 8000
    assert len({p.request.name for p in workload}) == len(workload)


def test_inflation_removes_pods_when_the_trace_is_already_over_the_target():
    pods = load_pods(OPENB / "openb_pod_list_multigpu50.csv")
    workload = inflate(pods, 6212, 1.3, np.random.default_rng(42))
    assert len(workload) < len(pods)
    assert sum(p.request.total_gpu_milli for p in workload) <= 1.3 * 6212 * 1000


def test_the_same_seed_gives_the_same_replay(small_trace):
    nodes, pods = small_trace
    first = replay(load_nodes(nodes), load_pods(pods), "fgd", 5)
    second = replay(load_nodes(nodes), load_pods(pods), "fgd", 5)
    assert first.allocation_pct_by_arrived == second.allocation_pct_by_arrived
    assert first.fragmentation_pct_by_arrived == second.fragmentation_pct_by_arrived


def test_it_reads_the_five_column_multigpu_lists():
    pods = load_pods(OPENB / "openb_pod_list_multigpu20.csv")
    assert len(pods) == 8324 and all(p.request.gpu_models is None for p in pods)


@pytest.mark.parametrize(("policy", "published"), [("fgd", 95.39), ("bestfit", 93.08)])
def test_it_reproduces_the_published_allocation_on_default(policy, published):
    nodes = load_nodes(OPENB / "openb_node_list_gpu_node.csv")
    pods = load_pods(OPENB / "openb_pod_list_default.csv")
    result = replay(nodes, pods, policy, 42, trace="default")
    # One seed is noisier than the ten-seed mean the bench checks (within 1.0 point there).
    assert abs(result.allocation_pct_by_arrived[130] - published) < 1.0
    # The curve tracks arrivals until the cluster fills up.
    assert abs(result.allocation_pct_by_arrived[50] - 50) < 0.5


def test_allocation_stays_within_the_cluster_and_behind_arrivals():
    nodes = load_nodes(OPENB / "openb_node_list_gpu_node.csv")
    result = replay(nodes, load_pods(OPENB / "openb_pod_list_gpushare40.csv"), "packing", 2)
    values = [v for v in result.allocation_pct_by_arrived if v is not None]
    assert len(values) == 131 and all(0 <= v <= 100 for v in values)
    # Placed GPUs can never run ahead of the GPUs that arrived (rounding to whole percents aside).
    assert all(v <= pct + 1 for pct, v in enumerate(values))


def _one_line_error(result, *words):
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0]


def test_a_missing_column_is_a_one_line_error(tmp_path, small_trace):
    nodes, _ = small_trace
    pods = _write(tmp_path, "bad.csv", "name,cpu_milli,num_gpu,gpu_milli\np1,1000,1,500\n")
    _one_line_error(_run("--nodes", nodes, "--pods", pods, "--policy", "fgd", "--seed", 1), "memory_mib")


def test_a_negative_request_is_a_one_line_error(tmp_path, small_trace):
    nodes, _ = small_trace
    pods = _write(tmp_path, "neg.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,-1000,1024,1,500\n")
    _one_line_error(_run("--nodes", nodes, "--pods", pods, "--policy", "fgd", "--seed", 1), "cpu_milli", "negative", "line 2")


def test_an_unknown_policy_is_a_one_line_error(small_trace):
    nodes, pods = small_trace
    _one_line_error(_run("--nodes", nodes, "--pods", pods, "--policy", "tetris", "--seed", 1), "tetris", "portal")


def test_a_file_that_does_not_exist_is_a_one_line_error(tmp_path, small_trace):
    _, pods = small_trace
    _one_line_error(_run("--nodes", tmp_path / "nope.csv", "--pods", pods, "--policy", "fgd", "--seed", 1), "nope.csv", "does not exist")


def test_a_missing_argument_is_a_one_line_error(small_trace):
    nodes, pods = small_trace
    _one_line_error(_run("--nodes", nodes, "--pods", pods, "--policy", "fgd"), "--seed")


def test_a_gpu_share_over_one_gpu_is_refused(tmp_path):
    path = _write(tmp_path, "big.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,1000,1024,1,1500\n")
    with pytest.raises(TraceError, match="at most 1000"):
        load_pods(path)


def test_portal_allocates_more_than_published_fgd_on_default():
    nodes = load_nodes(OPENB / "openb_node_list_gpu_node.csv")
    result = replay(nodes, load_pods(OPENB / "openb_pod_list_default.csv"), "portal", 42, trace="default")
    # Published FGD: 95.39 (mean of seeds 42-51); the bench checks all five tuning traces.
    assert result.allocation_pct_by_arrived[130] >= 95.39


def test_a_pod_list_without_gpu_pods_is_a_one_line_error_not_a_hang(tmp_path, small_trace):
    nodes, _ = small_trace
    pods = _write(tmp_path, "cpu.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,1000,1024,0,0\np2,2000,1024,0,0\n")
    result = subprocess.run(
        [sys.executable, "-m", "runners.scheduler.replay", "--nodes", str(nodes), "--pods", str(pods), "--policy", "fgd",
         "--seed", "1"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )
    _one_line_error(result, "asks for no GPUs", "--tune 0")
    # Replayed as it is, the same list runs.
    assert _run("--nodes", nodes, "--pods", pods, "--policy", "fgd", "--seed", 1, "--tune", 0).returncode == 0


def test_a_node_list_without_gpus_is_a_one_line_error(tmp_path, small_trace):
    _, pods = small_trace
    nodes = _write(tmp_path, "cpu-nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\nc1,32000,65536,0,\nc2,32000,65536,0,\n")
    result = _run("--nodes", nodes, "--pods", pods, "--policy", "fgd", "--seed", 1)
    _one_line_error(result, "2 node(s) but no GPUs")
    assert "Warning" not in result.stderr


def test_a_negative_seed_is_a_one_line_error(small_trace):
    nodes, pods = small_trace
    _one_line_error(_run("--nodes", nodes, "--pods", pods, "--policy", "fgd", "--seed", -1), "--seed", "-1")
    with pytest.raises(ValueError, match="seed"):
        replay(load_nodes(nodes), load_pods(pods), "fgd", -3)


def test_the_command_line_takes_the_mix_and_the_window(small_trace):
    nodes, pods = small_trace
    result = _run("--nodes", nodes, "--pods", pods, "--policy", "portal", "--seed", 1, "--mix", "online", "--window", 8, "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert (out["mix"], out["window"]) == ("online", 8)
    _one_line_error(_run("--nodes", nodes, "--pods", pods, "--policy", "fgd", "--seed", 1, "--window", 0), "window")
    _one_line_error(_run("--nodes", nodes, "--pods", pods, "--policy", "fgd", "--seed", 1, "--mix", "oracle"), "oracle")
