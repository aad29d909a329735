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
     "created_at": "2025-01-01T12:00:00.456+00:00", "attempt": 0}

`path` is relative to the job folder; `attempt` is PORTAL_ATTEMPT of the process that
saved it, as in a metric line (records written before it was added have none). The line is appended only once the file
is durable (written, fsynced, renamed into place), but old checkpoints are
pruned later, so a line may name a file that no longer exists.

Rank 0 also prints each record to stdout as one tagged line (`PORTAL_METRIC {...}`,
`PORTAL_CHECKPOINT {...}`), so a backend that cannot read the job folder (on
Kubernetes it is a volume in the cluster) reads progress from the pod's log
instead (`parse_log`).

Every reader here tolerates a half-written last line (the writer may be in
the middle of it, or may have been killed there) and skips lines it cannot
parse rather than failing. `read_jsonl_chunk` reads a file piecewise, from a byte
offset and within a byte budget, whatever the file's size: what the local backend's
`job_progress` hands the portal a little at a time.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import NamedTuple

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


class Chunk(NamedTuple):
    records: list[dict]  # the records of the whole lines taken (objects with an integer "step")
    offset: int  # where the next read starts
    taken: int  # the bytes of the lines taken (0: nothing new)


def read_jsonl_chunk(path: str | Path, offset: int, budget: int, *, whole_budget: bool = True) -> Chunk:
    """The records of the whole lines in at most `budget` bytes of the file from `offset`.

    Seeks, never reads from the start: the cost is at most `budget` bytes however long the file.
    A torn last line (no newline yet) is left for the next call. A line longer than a whole
    budget could never be taken in one piece: with `whole_budget` (this call was given all
    that one read may take) its first `budget` bytes are passed over, and the rest of it,
    unparsable on its own, is skipped by the next call. A file shorter than `offset` was
    replaced: it is read from its start. A missing file reads as nothing, offset unchanged.
    """
    offset = max(0, int(offset))
    try:
        with open(path, "rb") as stream:
            if os.fstat(stream.fileno()).st_size < offset:
                offset = 0
            stream.seek(offset)
            data = stream.read(max(0, budget))
    except FileNotFoundError:
        return Chunk([], offset, 0)
    end = data.rfind(b"\n") + 1
    if end == 0 and whole_budget and 0 < budget == len(data):
        return Chunk([], offset + budget, budget)  # one line longer than any read: not a record of ours
    return Chunk([r for r in _parse_lines(data[:end]) if isinstance(r.get("step"), int)], offset + end, end)


def _parse_lines(data: bytes) -> list[dict]:
    """The JSON objects of these lines; a line that is not one is skipped."""
    lines = data.splitlines()
    try:
        # All at once, as one array, is three times faster than line by line; any bad line
        # (or an empty one) fails the whole, and then each line is tried on its own.
        parsed = json.loads(b"[" + b",".join(lines) + b"]")
        if len(parsed) != len(lines):  # a line of several values ("{...}, {...}"): not a record
            raise ValueError("not one value a line")
    except ValueError:
        parsed = []
        for line in lines:
            try:
                parsed.append(json.loads(line))
            except ValueError:
                continue
    return [record for record in parsed if isinstance(record, dict)]


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
