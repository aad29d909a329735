"""How busy a workload keeps its (simulated) GPU, as each rank measures it: the reader, and the writer's names.

The writer (``ActivityMeter``: ``with meter.busy():`` around the compute, a record every ~``WINDOW_S``)
and the file's name and format are the SDK's (``gpuportal._activity``, ``gpuportal._protocol``: stdlib
only), so the shipped trainer, a team's script and the shipped server write the same record::

    {"at": 1735732800.123, "window_s": 2.004, "busy_fraction": 0.9312, "memory_used_mib": 341.2}

``at`` is when the window ended (seconds since the epoch); ``busy_fraction`` (0..1) the share of the
window spent computing; ``memory_used_mib`` the resident memory of the process that holds the model,
null where /proc cannot be read. A record older than ``STALE_AFTER_S`` comes from a process that
stopped writing (killed, stopped or ended): ``read_activity`` gives nothing for it rather than an
old figure. A script whose loop hangs goes on writing windows with nothing busy in them (the SDK
writes from a thread of its own), so it reads idle.

Where a training rank writes: into its attempt's folder of the local backend's layout
(``trainer_activity_file``) when that folder exists, and nowhere otherwise (on Kubernetes, where
DCGM measures the GPUs). The server is told its file by ``--activity-file``. Stdlib only, like
``progress``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from gpuportal._activity import STALE_AFTER_S, WINDOW_S, ActivityMeter, resident_mib
from gpuportal._protocol import ATTEMPTS_DIR, activity_file
from gpuportal._protocol import attempt_activity_file as trainer_activity_file

__all__ = [
    "ATTEMPTS_DIR", "STALE_AFTER_S", "WINDOW_S", "ActivityMeter", "activity_file", "read_activity", "resident_mib",
    "trainer_activity_file",
]


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
