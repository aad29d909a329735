"""How busy a workload keeps its (simulated) GPU: the fraction of wall time it spends computing.

A machine without GPUs has no NVML to ask, so the shipped trainer and server measure themselves:
``with meter.busy():`` around the compute (the trainer's forward, backward and optimizer step; the
server's prompt and decode steps), and every ~``WINDOW_S`` each rank writes what the last window
held to ``rank-<r>.activity.json`` in its attempt's folder::

    {"at": 1735732800.123, "window_s": 2.004, "busy_fraction": 0.9312, "memory_used_mib": 341.2}

``at`` is when the window ended (seconds since the epoch); ``busy_fraction`` (0..1) the share of
the window spent inside ``busy()``, counting a compute still running at the window's end up to
then; ``memory_used_mib`` the resident memory (RSS, from /proc) of the process that holds the
model (the trainer's rank; the server's engine process), null where /proc cannot be read. Written
through a temporary file and a rename, so a reader never sees half a record; a final record is
written at exit. A record older than ``STALE_AFTER_S`` comes from a process that stopped writing
(hung, killed or ended): ``read_activity`` gives nothing for it rather than an old figure.

Where the trainer writes: it has no flag for it (its command line is the job's spec), so it writes
into its attempt's folder of the local backend's layout (``trainer_activity_file``) when that folder
exists, and nowhere otherwise (on Kubernetes, where DCGM measures the GPUs). The server is told
its file by ``--activity-file``.

The cost: two clock reads and two uncontended lock round trips per ``busy()``, and one clock
read per ``maybe_write`` between writes. Stdlib only, like ``progress``.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

WINDOW_S = 2.0
STALE_AFTER_S = 3 * WINDOW_S
# The local backend's attempt folders: <job dir>/attempts/<attempt>/ (runners.backends.local_jobs).
ATTEMPTS_DIR = "attempts"


def activity_file(attempt_dir: str | Path, rank: int) -> Path:
    return Path(attempt_dir) / f"rank-{rank}.activity.json"


def trainer_activity_file(job_dir: str | Path, attempt: int, rank: int) -> Path | None:
    """Where a trainer rank writes its activity: its attempt's folder when the local backend made one, else None."""
    attempt_dir = Path(job_dir) / ATTEMPTS_DIR / str(attempt)
    return activity_file(attempt_dir, rank) if attempt_dir.is_dir() else None


def resident_mib() -> float | None:
    """This process's resident memory in MiB, from /proc/self/statm; None where there is no /proc."""
    try:
        with open("/proc/self/statm") as stream:
            pages = int(stream.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class ActivityMeter:
    """The share of wall time spent inside ``busy()``, window by window; safe to write from another thread.

    ``busy()`` is not re-entrant: one compute at a time, as in the trainer's loop and the server's engine thread.
    """

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.perf_counter) -> None:
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._window_start = clock()
        self._busy_s = 0.0
        self._busy_since: float | None = None

    @contextmanager
    def busy(self) -> Iterator[None]:
        with self._lock:
            started = self._busy_since = self._clock()
        try:
            yield
        finally:
            with self._lock:
                # A window that ended meanwhile counted this compute up to its end already.
                self._busy_s += self._clock() - max(started, self._window_start)
                self._busy_since = None

    def roll(self) -> tuple[float, float]:
        """(the window's length in seconds, its busy fraction); a new window starts now."""
        with self._lock:
            now = self._clock()
            busy = self._busy_s
            if self._busy_since is not None:
                busy += now - max(self._busy_since, self._window_start)
            length = now - self._window_start
            self._window_start, self._busy_s = now, 0.0
        return length, min(1.0, busy / length) if length > 0 else 0.0

    def write(self, path: Path) -> bool:
        """Close the window and write its record to `path` atomically; False if it could not be written.

        A write that fails (the attempt's folder removed, a full disk) is skipped: measuring must never
        stop the work it measures.
        """
        length, fraction = self.roll()
        record = {
            "at": round(time.time(), 3), "window_s": round(length, 3), "busy_fraction": round(fraction, 4),
            "memory_used_mib": None if (rss := resident_mib()) is None else round(rss, 1),
        }
        temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            temp.write_text(json.dumps(record))
            os.replace(temp, path)
        except OSError:
            temp.unlink(missing_ok=True)
            return False
        return True

    def maybe_write(self, path: Path) -> bool:
        """Write once the window has lasted `window_s`; otherwise only a clock read."""
        if self._clock() - self._window_start < self.window_s:
            return False
        return self.write(path)


def read_activity(path: Path, *, now: float) -> dict | None:
    """The record at `path` as written, or None when there is none, it cannot be parsed or it is stale at `now`."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    at, fraction, memory = record.get("at"), record.get("busy_fraction"), record.get("memory_used_mib")
    if not all(_number(value) for value in (at, fraction)) or not (memory is None or _number(memory)):
        return None
    if now - at > STALE_AFTER_S:
        return None
    return {"at": float(at), "busy_fraction": min(1.0, max(0.0, float(fraction))),
            "memory_used_mib": None if memory is None else float(memory)}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
