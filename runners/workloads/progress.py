"""What a training job leaves in its job folder, read without torch.

The portal's web process imports this module to show progress, so it must stay
stdlib-only: no torch, no numpy, no Django. `train.py` imports its constants
from here, which keeps the writer and the reader agreeing on names and codes.

Layout of a job folder::

    <job-dir>/metrics.jsonl           one line per finished step, written by rank 0
    <job-dir>/checkpoints.jsonl       one line per checkpoint saved, written by rank 0
    <job-dir>/checkpoints/step-00000010.pt

A line of metrics.jsonl::

    {"step": 12, "loss": 3.21, "samples_per_s": 2450.3,
     "time": "2025-01-01T12:00:00.123+00:00", "attempt": 0}

`step` counts finished optimizer steps from 1 and goes on across resumes;
`samples_per_s` is the throughput of all replicas together; `attempt` is
PORTAL_ATTEMPT of the process that wrote it. After a hard kill (SIGKILL, a
crash) the steps after the last checkpoint are trained again, so a step can
appear twice with different attempts: `latest_per_step` keeps the newest.

A line of checkpoints.jsonl::

    {"step": 10, "path": "checkpoints/step-00000010.pt", "bytes": 523511,
     "created_at": "2025-01-01T12:00:00.456+00:00"}

`path` is relative to the job folder. The line is appended only once the file
is durable (written, fsynced, renamed into place), but old checkpoints are
pruned later, so a line may name a file that no longer exists.

Rank 0 also prints each record to stdout as one tagged line (`PORTAL_METRIC {...}`,
`PORTAL_CHECKPOINT {...}`), so a backend that cannot read the job folder (on
Kubernetes it is a volume in the cluster) reads progress from the pod's log
instead (`parse_log`).

Every reader here tolerates a half-written last line (the writer may be in
the middle of it, or may have been killed there) and skips lines it cannot
parse rather than failing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# Exit codes of `python -m runners.workloads.train`.
EXIT_OK = 0
"""Every requested step is done (and the final checkpoint saved)."""
EXIT_FAILED = 1
"""An error; the traceback is on stderr. Bad arguments exit 2 (argparse's usage error)."""
EXIT_CHECKPOINTED_ON_SIGNAL = 75
"""Stopped early on SIGTERM/SIGINT or --max-runtime-s, after a checkpoint of the step
reached was saved: relaunch the same command to resume. 75 is EX_TEMPFAIL in sysexits.h."""

METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_FILE = "checkpoints.jsonl"
CHECKPOINT_DIR = "checkpoints"

_CHECKPOINT_NAME = re.compile(r"^step-(\d+)\.pt$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint file name, or None for anything else (temp files, set-aside files)."""
    match = _CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


def read_jsonl(path: str | Path) -> list[dict]:
    """The JSON objects of a .jsonl file, in order; [] when it does not exist."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    records = []
    for line in data.splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a torn last line, or garbage: not worth failing a page over
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_metrics(job_dir: str | Path) -> list[dict]:
    """Every step record in the order written (see the module docstring for repeats)."""
    return [r for r in read_jsonl(Path(job_dir) / METRICS_FILE) if isinstance(r.get("step"), int)]


def latest_per_step(metrics: list[dict]) -> list[dict]:
    """One record per step, the last written, sorted by step: the run as it stands."""
    by_step = {record["step"]: record for record in metrics}
    return [by_step[step] for step in sorted(by_step)]


def read_checkpoints(job_dir: str | Path) -> list[dict]:
    """Every checkpoint record in the order written, including ones pruned since."""
    return [r for r in read_jsonl(Path(job_dir) / CHECKPOINTS_FILE) if isinstance(r.get("step"), int)]


def checkpoint_files(job_dir: str | Path) -> dict[int, Path]:
    """The checkpoint files present now, by step (temp and set-aside files excluded)."""
    folder = Path(job_dir) / CHECKPOINT_DIR
    try:
        entries = list(folder.iterdir())
    except FileNotFoundError:
        return {}
    found = {}
    for entry in entries:
        step = checkpoint_step(entry.name)
        if step is not None and entry.is_file():
            found[step] = entry
    return dict(sorted(found.items()))


def latest_checkpoint_step(job_dir: str | Path) -> int | None:
    """The step the job would resume from, or None if it would start afresh.

    Judged from the files on disk, since those are what a restart loads. A file
    only gets its final name once complete, so this is right unless a file was
    damaged afterwards; the trainer sets such a file aside when it finds it.
    """
    files = checkpoint_files(job_dir)
    return max(files) if files else None


METRIC_TAG = "PORTAL_METRIC"
CHECKPOINT_TAG = "PORTAL_CHECKPOINT"


def tagged_line(tag: str, record: dict) -> str:
    """The stdout line that carries one record (see parse_log)."""
    return f"{tag} {json.dumps(record, sort_keys=True)}"


def parse_log(text: str) -> tuple[list[dict], list[dict]]:
    """The metric and checkpoint records in a replica's log, in order; other lines are skipped."""
    metrics, checkpoints = [], []
    for line in text.splitlines():
        tag, _, payload = line.partition(" ")
        if tag not in (METRIC_TAG, CHECKPOINT_TAG):
            continue
        try:
            record = json.loads(payload)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            (metrics if tag == METRIC_TAG else checkpoints).append(record)
    return metrics, checkpoints
