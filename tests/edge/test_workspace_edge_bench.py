"""The workspace edge bench (bench/workspace_edge.py) run tiny: JupyterLab with a kernel and a terminal behind a
real edge, every metric measured both ways, the figures finite (what they are is the bench's to say: no speed is
asserted here)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import workspace_edge

pytestmark = pytest.mark.e2e  # JupyterLab, its kernel, its terminal and the edge, each a process

REPO = Path(__file__).resolve().parents[2]


def test_the_bench_measures_every_metric_through_the_edge_and_direct(tmp_path):
    out = tmp_path / "figures.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "workspace_edge.py"), "--requests", "20", "--round-trips", "10",
         "--handshakes", "3", "--repeats", "2", "--json", str(out)],
        cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(figures["summary"]) == set(workspace_edge.METRICS)
    assert len(figures["rounds"]) == 2 and [r["order"] for r in figures["rounds"]] == [["direct", "edge"],
                                                                                       ["edge", "direct"]]
    for metric, kinds in figures["summary"].items():
        assert set(kinds) == {"direct", "edge", "added"}
        for kind, quantiles in kinds.items():
            for quantile in ("p50", "p99"):
                spread = quantiles[quantile]
                assert all(math.isfinite(spread[stat]) for stat in ("median", "min", "max")), (metric, kind, spread)
                if kind != "added":
                    assert 0 < spread["min"] <= spread["median"] <= spread["max"], (metric, kind, spread)
    for label in workspace_edge.METRICS.values():
        assert f"| {label} " in run.stdout, run.stdout
