"""The dataset read bench (bench/dataset_read.py) run tiny, its S3 server a thread of this process: it reads the
whole dataset in each of its three ways and reports each one's figures (the ratio is the bench's to measure, not
this test's)."""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # a server thread on a loopback port

BENCH = Path(__file__).resolve().parents[2] / "bench" / "dataset_read.py"


def test_the_bench_reads_every_sample_three_ways_and_reports_their_rates(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("dataset_read_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "figures.json"
    figures = bench.main(["--files", "120", "--file-kb", "2", "--shard-mb", "0.1", "--repeats", "2",
                          "--tune-files", "30", "--batch-sizes", "4", "--server", "thread", "--no-pin",
                          "--json", str(out)])
    assert out.is_file()
    assert figures["files"] == 120 and figures["shards"] >= 2  # several shards: the prefetch has work
    assert set(figures["s3fs_tuning"]) == {"open", "cat_file", "cat:4"}
    assert figures["s3fs_reader"] in figures["s3fs_tuning"]
    for mode in ("a_s3fs", "b_sdk_stream", "c_sdk_node_cache"):
        assert len(figures["runs"][mode]) == 2
        summary = figures["summary"][mode]
        assert 0 < summary["samples_per_s"]["min"] <= summary["samples_per_s"]["median"] <= summary["samples_per_s"]["max"]
        assert summary["mb_per_s"]["median"] > 0
    assert figures["ratio_c_over_a"] > 0 and "(c)/(a) = " in capsys.readouterr().out
