"""What a training job leaves in its job folder, read without torch.

The portal's web process imports this module to show progress, so it must stay
stdlib-only: no torch, no numpy, no Django. The names, record shapes, tags and
exit codes are the SDK's (`gpuportal._protocol`, stdlib-only too, installed in
the portal's environment): the shipped trainer and a team's script write through
the SDK, and this module reads what they wrote.

Layout of a job folder::

    <job-dir>/metrics.jsonl           one line per reported step, written by rank 0
    <job-dir>/checkpoints.jsonl       one line per checkpoint saved, written by rank 0
    <job-dir>/stops.jsonl             one line each time a stop is seen or checkpointed, written by rank 0
    <job-dir>/checkpoints/step-00000010.pt   (.pt, .ckpt, or a folder step-00000010)

A line of metrics.jsonl::

    {"step": 12, "loss": 3.21, "samples_per_s": 2450.3,
     "time": "2025-01-01T12:00:00.123+00:00", "attempt": 0}

`step` counts finished optimizer steps from 1 and goes on across resumes;
the other numbers are the script's own (the shipped trainer's: `loss`, and
`samples_per_s`, the throughput of all replicas together); `attempt` is
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

A line of stops.jsonl: the script saw the portal's request to stop (a signal, its
maximum runtime) and is on its way out; the newest line of an attempt names the
checkpoint it left. An attempt that exits 0 with such a line was checkpointed on
a stop, as one that exits 75 (`stop_of_attempt`)::

    {"attempt": 0, "rank": 0, "reason": "SIGTERM received", "checkpoint_step": 40,
     "time": "2025-01-01T12:00:00.789+00:00"}

Rank 0 also prints each record to stdout as one tagged line (`PORTAL_METRIC {...}`,
`PORTAL_CHECKPOINT {...}`, `PORTAL_STOPPED {...}`), so a backend that cannot read the job folder (on
Kubernetes it is a volume in the cluster) reads progress from the pod's log
instead (`parse_log`, `parse_log_records`).

Every reader here tolerates a half-written last line (the writer may be in
the middle of it, or may have been killed there) and skips lines it cannot
parse rather than failing. `read_jsonl_chunk` reads a file piecewise, from a byte
offset and within a byte budget, whatever the file's size: what the local backend's
`job_progress` hands the portal a little at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from gpuportal._protocol import (
    CHECKPOINT_DIR,
    CHECKPOINT_TAG,
    CHECKPOINTS_FILE,
    DATASET_TAG,
    DATASETS_FILE,
    EXIT_CHECKPOINTED_ON_SIGNAL,
    EXIT_FAILED,
    EXIT_OK,
    METRIC_TAG,
    METRICS_FILE,
    STOPPED_TAG,
    STOPS_FILE,
    checkpoint_name,
    checkpoint_step,
    tagged_line,
)
from gpuportal._protocol import checkpoint_entries as checkpoint_files

__all__ = [
    "CHECKPOINTS_FILE", "CHECKPOINT_DIR", "CHECKPOINT_TAG", "DATASETS_FILE", "DATASET_TAG", "EXIT_CHECKPOINTED_ON_SIGNAL", "EXIT_FAILED", "EXIT_OK",
    "METRICS_FILE", "METRIC_TAG", "STOPPED_TAG", "STOPS_FILE", "Chunk", "LogRecords", "checkpoint_files",
    "checkpoint_name", "checkpoint_step", "has_step", "is_dataset_read", "is_stop", "latest_checkpoint_step", "latest_per_step",
    "parse_log", "parse_log_records", "read_checkpoints", "read_jsonl", "read_jsonl_chunk", "read_metrics", "read_stops",
    "stop_of_attempt", "tagged_line",
]


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


def has_step(record: dict) -> bool:
    """A metric's or a checkpoint's record: an object with an integer "step"."""
    return isinstance(record.get("step"), int)


def is_stop(record: dict) -> bool:
    """A stop record: an object with an integer "attempt"."""
    attempt = record.get("attempt")
    return isinstance(attempt, int) and not isinstance(attempt, bool)


def is_dataset_read(record: dict) -> bool:
    """A dataset read record (gpuportal.datasets.record_read): a string "name" and an integer "version"."""
    version = record.get("version")
    return isinstance(record.get("name"), str) and isinstance(version, int) and not isinstance(version, bool)


def read_jsonl_chunk(path: str | Path, offset: int, budget: int, *, whole_budget: bool = True,
                     keep: Callable[[dict], bool] = has_step) -> Chunk:
    """The records (objects that `keep` takes: by default those with a step) of the whole lines in at most
    `budget` bytes of the file from `offset`.

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
    return Chunk([r for r in _parse_lines(data[:end]) if keep(r)], offset + end, end)


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
    return [r for r in read_jsonl(Path(job_dir) / METRICS_FILE) if has_step(r)]


def latest_per_step(metrics: list[dict]) -> list[dict]:
    """One record per step, the last written, sorted by step: the run as it stands."""
    by_step = {record["step"]: record for record in metrics}
    return [by_step[step] for step in sorted(by_step)]


def read_checkpoints(job_dir: str | Path) -> list[dict]:
    """Every checkpoint record in the order written, including ones pruned since."""
    return [r for r in read_jsonl(Path(job_dir) / CHECKPOINTS_FILE) if has_step(r)]


def latest_checkpoint_step(job_dir: str | Path) -> int | None:
    """The step the job would resume from, or None if it would start afresh.

    Judged from the files on disk, since those are what a restart loads. A file
    only gets its final name once complete, so this is right unless a file was
    damaged afterwards; the trainer sets such a file aside when it finds it.
    """
    files = checkpoint_files(job_dir)
    return max(files) if files else None


def read_stops(job_dir: str | Path) -> list[dict]:
    """Every stop record in the order written (objects with an integer "attempt")."""
    return [r for r in read_jsonl(Path(job_dir) / STOPS_FILE) if is_stop(r)]


def stop_of_attempt(job_dir: str | Path, attempt: int) -> dict | None:
    """The newest stop record of this attempt, or None when it saw no stop."""
    found = [record for record in read_stops(job_dir) if record["attempt"] == attempt]
    return found[-1] if found else None


class LogRecords(NamedTuple):
    metrics: list[dict]
    checkpoints: list[dict]
    stops: list[dict]
    datasets: list[dict]  # the datasets the script opened (PORTAL_DATASET lines)


def parse_log_records(text: str) -> LogRecords:
    """The metric, checkpoint, stop and dataset read records in a replica's log, in order; other lines are
    skipped."""
    found = LogRecords([], [], [], [])
    kinds = {METRIC_TAG: found.metrics, CHECKPOINT_TAG: found.checkpoints, STOPPED_TAG: found.stops,
             DATASET_TAG: found.datasets}
    keep = {METRIC_TAG: has_step, CHECKPOINT_TAG: has_step, STOPPED_TAG: is_stop, DATASET_TAG: is_dataset_read}
    for line in text.splitlines():
        tag, _, payload = line.partition(" ")
        if tag not in kinds:
            continue
        try:
            record = json.loads(payload)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if keep[tag](record):
            kinds[tag].append(record)
    return found


def parse_log(text: str) -> tuple[list[dict], list[dict]]:
    """The metric and checkpoint records in a replica's log, in order (the stops: `parse_log_records`)."""
    records = parse_log_records(text)
    return records.metrics, records.checkpoints
