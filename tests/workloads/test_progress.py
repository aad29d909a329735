"""The torch-free readers the portal uses on a job folder that may be written to at that moment."""

import json
import subprocess
import sys
from pathlib import Path

from runners.workloads import progress

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


def test_the_workloads_stay_free_of_django_and_progress_of_torch():
    # In a fresh interpreter: this test process has Django loaded already.
    check = """
import sys
import runners.workloads.progress
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
