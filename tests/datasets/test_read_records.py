"""The SDK's record of which dataset version a script read, as the backends' progress readers hand it on: the
local backend from the job folder's datasets.jsonl, the Kubernetes backend from the PORTAL_DATASET lines of the
pod's log; a line that is not such a record is skipped."""

import pytest
from gpuportal import _protocol as protocol
from gpuportal.datasets import record_read

from runners.backends import k8s_jobs
from runners.backends.local_jobs import LocalJobs
from runners.workloads import progress

pytestmark = pytest.mark.unit

READ = {"name": "images", "version": 3, "attempt": 1, "rank": 0, "time": "2026-12-05T10:00:00.000+00:00"}


def test_the_pods_log_lines_carry_the_read_records_beside_the_metrics():
    lines = [
        f"2026-12-05T10:00:01.100000000Z {protocol.tagged_line(protocol.DATASET_TAG, READ)}",
        '2026-12-05T10:00:01.200000000Z PORTAL_METRIC {"step": 1, "loss": 2.0}',
        '2026-12-05T10:00:01.300000000Z PORTAL_DATASET {"name": "images", "version": "3"}',  # not a number
        "2026-12-05T10:00:01.400000000Z PORTAL_DATASET not json",
    ]
    chunk = k8s_jobs.read_progress(("\n".join(lines) + "\n").encode(), k8s_jobs.LogCursor(41, 1, "uid-1"),
                                   limit=10_000)
    assert chunk.datasets == [READ]
    assert [m["step"] for m in chunk.metrics] == [1]
    # Read again from its cursor, nothing comes twice.
    again = k8s_jobs.read_progress(("\n".join(lines) + "\n").encode(), chunk.cursor, limit=10_000)
    assert again.datasets == [] and again.metrics == []


def test_the_local_backend_reads_datasets_jsonl_from_its_cursor(tmp_path, capsys):
    jobs = LocalJobs(jobs_dir=tmp_path / "jobs", state=None, real_gpu_nodes=lambda: ())
    job_dir = jobs.job_dir(7)
    record_read(job_dir, name="images", version=3, attempt=1, rank=0)
    printed = capsys.readouterr().out
    assert printed.startswith(f"{protocol.DATASET_TAG} ") and progress.parse_log_records(printed).datasets[0]["version"] == 3
    with open(job_dir / protocol.DATASETS_FILE, "a") as handle:
        handle.write('{"name": "images"}\n')  # no version: skipped
    first = jobs.progress(7, 1, {})
    assert [(r["name"], r["version"]) for r in first.datasets] == [("images", 3)]
    assert first.cursor["datasets"] == (job_dir / protocol.DATASETS_FILE).stat().st_size
    assert jobs.progress(7, 1, first.cursor).datasets == []
    record_read(job_dir, name="text", version=1, attempt=2, rank=0)
    assert [r["name"] for r in jobs.progress(7, 2, first.cursor).datasets] == ["text"]
