"""The torch-free readers the portal uses on a job folder that may be written to at that moment."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runners.workloads import progress

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def _lines(*records) -> str:
    return "".join(json.dumps(record) + "\n" for record in records)


def test_a_torn_last_line_is_left_out(tmp_path):
    whole = _lines(*({"step": s, "loss": 5.0 - s, "samples_per_s": 100.0, "time": "t", "attempt": 0} for s in (1, 2, 3)))
    (tmp_path / progress.METRICS_FILE).write_text(whole + '{"step": 4, "loss": 1.')

    assert [r["step"] for r in progress.read_metrics(tmp_path)] == [1, 2, 3]


def test_unparsable_and_foreign_lines_are_skipped_anywhere(tmp_path):
    (tmp_path / progress.CHECKPOINTS_FILE).write_text(
        _lines({"step": 10, "path": "checkpoints/step-00000010.pt", "bytes": 5, "created_at": "t"})
        + "garbage\n[1, 2]\n"
        + _lines({"no": "step"}, {"step": "20"})
        + _lines({"step": 30, "path": "checkpoints/step-00000030.pt", "bytes": 5, "created_at": "t"})
        + '{"step": 40, "pa'
    )

    assert [r["step"] for r in progress.read_checkpoints(tmp_path)] == [10, 30]


def test_missing_files_read_as_nothing(tmp_path):
    assert progress.read_metrics(tmp_path / "never") == []
    assert progress.read_checkpoints(tmp_path) == []
    assert progress.latest_checkpoint_step(tmp_path) is None


def test_latest_checkpoint_step_counts_only_complete_files(tmp_path):
    folder = tmp_path / progress.CHECKPOINT_DIR
    folder.mkdir()
    for name in ("step-00000010.pt", "step-00000020.pt", ".step-00000030.pt.tmp-123", "step-00000040.pt.corrupt", "notes.txt"):
        (folder / name).write_bytes(b"x")

    assert progress.latest_checkpoint_step(tmp_path) == 20
    assert list(progress.checkpoint_files(tmp_path)) == [10, 20]
    assert progress.checkpoint_name(7) == "step-00000007.pt"
    assert progress.checkpoint_step("step-00000007.pt") == 7


def test_latest_per_step_keeps_the_newest_attempt():
    records = [{"step": 1, "attempt": 0}, {"step": 2, "attempt": 0}, {"step": 2, "attempt": 1}, {"step": 3, "attempt": 1}]

    assert progress.latest_per_step(records) == [{"step": 1, "attempt": 0}, {"step": 2, "attempt": 1}, {"step": 3, "attempt": 1}]


def _metric(step: int) -> dict:
    return {"step": step, "loss": 1.0, "samples_per_s": 1.0, "time": "t", "attempt": 0}


def test_a_chunk_is_whole_lines_from_the_offset_within_the_budget(tmp_path):
    path = tmp_path / progress.METRICS_FILE
    whole = _lines(*map(_metric, range(1, 11)))
    path.write_text(whole + '{"step": 11, "lo')
    line = len(_lines(_metric(1)))

    first = progress.read_jsonl_chunk(path, 0, 3 * line + 5)
    assert [r["step"] for r in first.records] == [1, 2, 3] and first.offset == first.taken == 3 * line
    rest = progress.read_jsonl_chunk(path, first.offset, 10_000)
    assert [r["step"] for r in rest.records] == list(range(4, 11))
    assert rest.offset == len(whole), "the torn last line is left for the next read"
    assert progress.read_jsonl_chunk(path, rest.offset, 10_000) == ([], rest.offset, 0)
    with open(path, "a") as stream:
        stream.write('ss": 1.0}\n')
    assert [r["step"] for r in progress.read_jsonl_chunk(path, rest.offset, 10_000).records] == [11]


def test_a_chunk_costs_its_budget_however_long_the_file(tmp_path, monkeypatch):
    path = tmp_path / progress.METRICS_FILE
    path.write_text(_lines(*map(_metric, range(1, 20_001))))
    size = path.stat().st_size
    read_sizes = []
    real_open = open

    class Counted:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.stream.close()

        def fileno(self):
            return self.stream.fileno()

        def seek(self, *args):
            return self.stream.seek(*args)

        def read(self, n=-1):
            data = self.stream.read(n)
            read_sizes.append(len(data))
            return data

    monkeypatch.setattr(progress, "open", lambda *a, **k: Counted(real_open(*a, **k)), raising=False)

    chunk = progress.read_jsonl_chunk(path, size - 1000, 500)
    assert read_sizes == [500] and chunk.taken <= 500
    assert [r["step"] for r in chunk.records] and chunk.records[-1]["step"] < 20_000


def test_a_line_longer_than_a_whole_read_is_passed_over_not_waited_for(tmp_path):
    path = tmp_path / progress.METRICS_FILE
    path.write_text('{"step": 1, "junk": "' + "x" * 300 + '"}\n' + _lines(_metric(2)))

    assert progress.read_jsonl_chunk(path, 0, 100, whole_budget=False) == ([], 0, 0), "a share of a read waits"
    offset, steps = 0, []
    while (chunk := progress.read_jsonl_chunk(path, offset, 100)).taken:
        steps += [r["step"] for r in chunk.records]
        offset = chunk.offset
    assert steps == [2] and offset == path.stat().st_size


def test_a_chunk_skips_what_is_not_a_record_and_reads_a_replaced_file_afresh(tmp_path):
    path = tmp_path / progress.CHECKPOINTS_FILE
    assert progress.read_jsonl_chunk(path, 7, 100) == ([], 7, 0), "no file yet: nothing, the offset kept"
    path.write_text(_lines(_metric(1)) + "garbage\n\n[1]\n" + '{"step": 2}, {"step": 3}\n' + _lines({"step": "4"})
                    + _lines(_metric(5)))
    chunk = progress.read_jsonl_chunk(path, 0, 10_000)
    assert [r["step"] for r in chunk.records] == [1, 5] and chunk.offset == path.stat().st_size

    path.write_text(_lines(_metric(9)))  # shorter than the offset: a new file
    assert [r["step"] for r in progress.read_jsonl_chunk(path, chunk.offset, 10_000).records] == [9]


def test_the_workloads_stay_free_of_django_and_progress_of_torch():
    # In a fresh interpreter: this test process has Django loaded already.
    check = """
import sys
import runners.workloads.progress
import runners.workloads.env_policy
assert "torch" not in sys.modules and "numpy" not in sys.modules, "progress pulled in torch or numpy"
try:
    import runners.workloads.train
except ImportError:  # no torch in this venv: the progress half still counts
    pass
apps = ("django", "rest_framework", "celery", "portal", "tenants", "quotas", "frontend")
bad = sorted(m for m in sys.modules if m.split(".")[0] in apps or (m.startswith("runners.") and not m.startswith("runners.workloads")))
assert not bad, bad
"""
    result = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
