"""What a training job leaves in its job folder and on its stdout: the one place that names it.

The SDK writes these files, and the portal reads them (``runners.workloads.progress`` and
``runners.workloads.activity`` import their names from here). The portal's web process imports
this module, so it stays stdlib-only: no torch, no numpy, no Django.

Layout of a job folder::

    <job-dir>/metrics.jsonl              one line per reported step, written by rank 0
    <job-dir>/checkpoints.jsonl          one line per checkpoint saved, written by rank 0
    <job-dir>/stops.jsonl                one line each time a stop is seen or checkpointed, written by rank 0
    <job-dir>/checkpoints/step-00000010.pt     a checkpoint: a file (.pt, .ckpt) or a folder (step-00000010)
    <job-dir>/attempts/<n>/rank-<r>.activity.json   how busy each rank keeps its device (local backend only)

A line of metrics.jsonl (the metrics are the script's own, finite numbers)::

    {"step": 12, "loss": 3.21, "samples_per_s": 2450.3, "time": "2025-01-01T12:00:00.123+00:00", "attempt": 0}

A line of checkpoints.jsonl (``path`` relative to the job folder; appended only once the checkpoint is
durable: written, fsynced, renamed into place)::

    {"step": 10, "path": "checkpoints/step-00000010.pt", "bytes": 523511,
     "created_at": "2025-01-01T12:00:00.456+00:00", "attempt": 0}

A line of stops.jsonl: the script saw that the portal asked it to stop. ``checkpoint_step`` is the newest
checkpoint it had saved by then; the line is written again after each checkpoint saved once stopping, so
the newest line of an attempt names the checkpoint that attempt left::

    {"attempt": 0, "rank": 0, "reason": "SIGTERM received", "checkpoint_step": 40,
     "time": "2025-01-01T12:00:00.789+00:00"}

Rank 0 also prints each record to stdout as one tagged line (``PORTAL_METRIC {...}``,
``PORTAL_CHECKPOINT {...}``, ``PORTAL_STOPPED {...}``), so a backend that cannot read the job folder (on
Kubernetes it is a volume in the cluster) reads them from the pod's log instead.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

# Exit codes of a training process.
EXIT_OK = 0
"""Every requested step is done (and the final checkpoint saved)."""
EXIT_FAILED = 1
"""An error; the traceback is on stderr. Bad arguments exit 2 (argparse's usage error)."""
EXIT_CHECKPOINTED_ON_SIGNAL = 75
"""Stopped early on SIGTERM/SIGINT or the maximum runtime, after a checkpoint of the step reached was
saved: relaunch the same command to resume. 75 is EX_TEMPFAIL in sysexits.h. A script may instead exit 0
after a stop line (`STOPS_FILE`) of its attempt: the portal counts both the same."""

METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_FILE = "checkpoints.jsonl"
STOPS_FILE = "stops.jsonl"
# A line per dataset the script opened (gpuportal.datasets): {"name", "version", "attempt", "rank", "time"}.
DATASETS_FILE = "datasets.jsonl"
CHECKPOINT_DIR = "checkpoints"

METRIC_TAG = "PORTAL_METRIC"
CHECKPOINT_TAG = "PORTAL_CHECKPOINT"
STOPPED_TAG = "PORTAL_STOPPED"
TAGS = (METRIC_TAG, CHECKPOINT_TAG, STOPPED_TAG)
DATASET_TAG = "PORTAL_DATASET"  # the datasets.jsonl line on stdout

# What the launchers set (local backend and Kubernetes alike).
ENV_JOB_DIR = "TRAIN_JOB_DIR"
ENV_MAX_RUNTIME_S = "TRAIN_MAX_RUNTIME_S"
ENV_ATTEMPT = "PORTAL_ATTEMPT"
ENV_JOB = "PORTAL_JOB"
ENV_HYPERPARAMETERS = "PORTAL_HYPERPARAMETERS"
"""The spec's hyperparameters, as one JSON object."""
ENV_RESUME_FROM_STEP = "PORTAL_RESUME_FROM_STEP"
"""The step of the checkpoint the portal recorded for the job, when it names one."""
ENV_RESUME_FROM_PATH = "PORTAL_RESUME_FROM_PATH"
"""That checkpoint's path, relative to the job folder (or absolute)."""
ENV_DATASETS = "PORTAL_DATASETS"
"""The path of the attempt's datasets manifest (JSON): {"<name>": {"version": N, "shards": [{"sha256", "bytes",
"path" or "url"}]}}, read by gpuportal.datasets."""

# The local backend's attempt folders: <job dir>/attempts/<attempt>/ (runners.backends.local_jobs).
ATTEMPTS_DIR = "attempts"

# A checkpoint's name: step-<8 digits>, then .pt (torch.save), .ckpt (Lightning) or nothing (a folder).
# Temporary files start with a dot and set-aside ones end in .corrupt, so neither ever matches.
_CHECKPOINT_NAME = re.compile(r"^step-(\d+)(\.pt|\.ckpt)?$")


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def checkpoint_name(step: int, suffix: str = ".pt") -> str:
    return f"step-{step:08d}{suffix}"


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint's name, or None for anything else (temp files, set-aside files)."""
    match = _CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


def checkpoint_entries(job_dir: str | Path) -> dict[int, Path]:
    """The checkpoints present now (files and folders), by step, oldest first."""
    folder = Path(job_dir) / CHECKPOINT_DIR
    try:
        entries = list(folder.iterdir())
    except FileNotFoundError:
        return {}
    found = {}
    for entry in entries:
        step = checkpoint_step(entry.name)
        if step is not None and (entry.is_file() or entry.is_dir()):
            found[step] = entry
    return dict(sorted(found.items()))


def tagged_line(tag: str, record: dict) -> str:
    """The stdout line that carries one record."""
    return f"{tag} {json.dumps(record, sort_keys=True)}"


def activity_file(attempt_dir: str | Path, rank: int) -> Path:
    return Path(attempt_dir) / f"rank-{rank}.activity.json"


def attempt_activity_file(job_dir: str | Path, attempt: int, rank: int) -> Path | None:
    """Where a training rank writes its activity: its attempt's folder when the local backend made one, else None."""
    attempt_dir = Path(job_dir) / ATTEMPTS_DIR / str(attempt)
    return activity_file(attempt_dir, rank) if attempt_dir.is_dir() else None


# --- writing ---------------------------------------------------------------------------------------


def open_jsonl(path: Path) -> IO[str]:
    """Open for appending; if a killed writer left a torn last line, end it so ours stays whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torn = False
    try:
        with open(path, "rb") as existing:
            existing.seek(0, os.SEEK_END)
            if existing.tell():
                existing.seek(-1, os.SEEK_END)
                torn = existing.read(1) != b"\n"
    except FileNotFoundError:
        pass
    handle = open(path, "a", encoding="utf-8")
    if torn:
        handle.write("\n")
    return handle


def write_jsonl(handle: IO[str], record: dict, *, durable: bool = False) -> None:
    handle.write(json.dumps(record) + "\n")
    handle.flush()
    if durable:
        os.fsync(handle.fileno())


def append_jsonl(path: Path, record: dict, *, durable: bool = False) -> None:
    with open_jsonl(path) as handle:
        write_jsonl(handle, record, durable=durable)


def fsync_file(path: Path) -> None:
    """Fsync a file, or a folder (which makes a rename into it survive a power cut, not just the file's bytes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_file


def temp_name(final: Path) -> Path:
    """A name beside `final` that no reader takes for a checkpoint (a dot name, ending in this pid)."""
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def write_atomically(final: Path, write: Callable[[IO[bytes]], object]) -> None:
    """`write(stream)` into a temporary file beside `final`, fsynced, then renamed to `final`.

    A reader sees the whole file or no file; a kill at any point leaves at most a temporary file.
    """
    temp = temp_name(final)
    try:
        with open(temp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)


def fsync_tree(root: Path) -> int:
    """Fsync every file under `root` and every folder, deepest first; the bytes of its files."""
    size = 0
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(folder, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                size += os.fstat(fd).st_size
            finally:
                os.close(fd)
        fsync_dir(Path(folder))
    return size


def size_of(path: Path) -> int:
    """A file's bytes, or the bytes of every file under a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file())
