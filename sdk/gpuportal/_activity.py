"""How busy a training rank keeps its device: the fraction of wall time it spends computing.

A machine without GPUs has no NVML to ask, so a rank measures itself: ``with meter.busy():`` around the
compute (forward, backward and optimizer step), and every ~``WINDOW_S`` it writes what the last window
held to ``rank-<r>.activity.json`` in its attempt's folder::

    {"at": 1735732800.123, "window_s": 2.004, "busy_fraction": 0.9312, "memory_used_mib": 341.2}

``at`` is when the window ended (seconds since the epoch); ``busy_fraction`` (0..1) the share of the
window spent inside ``busy()``, counting a compute still running at the window's end up to then;
``memory_used_mib`` the resident memory (RSS, from /proc) of the process, null where /proc cannot be
read. Written through a temporary file and a rename, so a reader never sees half a record. A record
older than ``STALE_AFTER_S`` comes from a process that stopped writing (hung, killed or ended): the
portal's reader gives nothing for it rather than an old figure.

A script that never uses ``busy()`` is measured by its marks instead (``mark()``: each report and each
checkpoint): the time from one mark to the next counts as busy, and so does the time after the last one
until the next mark or until ``hold`` has passed (three times the last gap between marks, at least
``MIN_HOLD_S``). So a script that reports every step reads busy, and one that hangs reads idle soon after.

The cost: two clock reads and two uncontended lock round trips per ``busy()``; one write per window.
Stdlib only.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

WINDOW_S = 2.0
STALE_AFTER_S = 3 * WINDOW_S
MIN_HOLD_S = 10.0
"""The least time a mark keeps a script that does not use busy() counted busy."""


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

    ``busy()`` is not re-entrant: one compute at a time, as in a training loop or a server's engine thread.
    """

    def __init__(
        self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.perf_counter, *,
        min_hold_s: float = MIN_HOLD_S,
    ) -> None:
        self.window_s = window_s
        self.min_hold_s = min_hold_s
        self._clock = clock
        self._lock = threading.Lock()
        self._window_start = clock()
        self._busy_s = 0.0
        self._busy_since: float | None = None
        self._explicit = False  # busy() was used: marks count for nothing from then on
        self._mark_at: float | None = None
        self._hold_until = 0.0

    @contextmanager
    def busy(self) -> Iterator[None]:
        with self._lock:
            if not self._explicit:
                self._explicit = True
                self._close_mark(self._clock())
            started = self._busy_since = self._clock()
        try:
            yield
        finally:
            with self._lock:
                # A window that ended meanwhile counted this compute up to its end already.
                self._busy_s += self._clock() - max(started, self._window_start)
                self._busy_since = None

    def mark(self) -> None:
        """The script is working (a report, a checkpoint): see the module docstring. Ignored once busy() was used."""
        with self._lock:
            if self._explicit:
                return
            now = self._clock()
            gap = None if self._mark_at is None else now - self._mark_at
            self._close_mark(now)
            self._mark_at = now
            self._hold_until = now + max(self.min_hold_s, 3 * gap if gap is not None else 0.0)

    def _close_mark(self, now: float) -> None:
        # Under the lock: the time since the last mark, within this window and its hold, counts as busy.
        if self._mark_at is not None:
            self._busy_s += max(0.0, min(now, self._hold_until) - max(self._mark_at, self._window_start))
            self._mark_at = None

    def roll(self) -> tuple[float, float]:
        """(the window's length in seconds, its busy fraction); a new window starts now."""
        with self._lock:
            now = self._clock()
            busy = self._busy_s
            if self._busy_since is not None:
                busy += now - max(self._busy_since, self._window_start)
            if self._mark_at is not None:
                busy += max(0.0, min(now, self._hold_until) - max(self._mark_at, self._window_start))
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


class ActivityWriter:
    """A daemon thread that writes the meter's window to `path` every `window_s`, and a last one at `close()`.

    A thread, not the training loop, so a long compute inside busy() still reads busy, and a loop that hangs
    outside it reads idle (its windows go on being written, with nothing busy in them).
    """

    def __init__(self, meter: ActivityMeter, path: Path) -> None:
        self.meter = meter
        self.path = path
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuportal-activity", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.wait(self.meter.window_s):
            self.meter.write(self.path)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout=5)
        self.meter.write(self.path)  # the last window, however the run ends
