"""Run one attempt of a job's replicas on this host and leave their exit codes behind.

    python -m runners.workloads.supervise ATTEMPT_DIR

ATTEMPT_DIR holds ``launch.json``: {"replicas": [{"rank": 0, "argv": [...], "env": {...},
"memory_limit_bytes": N}, ...], "cwd": "..."}. Each replica starts with exactly that environment
and, when ``memory_limit_bytes`` is given, under that data-segment limit (RLIMIT_DATA, soft and
hard, set between fork and exec): every private writable mapping counts (heap, anonymous
mappings such as torch's tensors, thread stacks), so the replica's own memory can never grow
past it; an allocation beyond it fails (torch raises, the trainer exits 1). RLIMIT_AS would
also count the shared libraries mapped read-only and every address-space reservation, which
for torch is three times its resident size (and for CUDA, terabytes).

The supervisor detaches (double fork, its own session, so it outlives the worker that started
it and is never that worker's zombie), writes ``supervisor.pid`` ("<pid> <process group>"), starts
every replica in its process group with stdout and stderr to ``rank-<r>.log``, and writes
``rank-<r>.exit`` (the exit code; -N for a signal) as each one ends, each through a temporary
file and a rename. When a replica fails (not 0, not 75), the others get SIGTERM and, after
``failure_grace_s``, SIGKILL: a rank waiting forever for a dead peer must not hold GPUs.

SIGTERM to the process group reaches every replica (they checkpoint and exit 75); the
supervisor itself ignores it and goes on waiting, so the exit codes are still written.
SIGKILL to the group kills all, supervisor included: no exit files then, which is how the
portal tells a killed attempt from one that ended. Stdlib only.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

LAUNCH_FILE = "launch.json"
PID_FILE = "supervisor.pid"
EXIT_CODES_OK = (0, 75)


def log_path(attempt_dir: Path, rank: int) -> Path:
    return attempt_dir / f"rank-{rank}.log"


def exit_path(attempt_dir: Path, rank: int) -> Path:
    return attempt_dir / f"rank-{rank}.exit"


def _write_atomically(path: Path, text: str) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    with open(temp, "w") as stream:
        stream.write(text)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temp, path)


def _before_exec(memory_limit_bytes: int | None):
    """What a replica's child process does between fork and exec (this process has no other threads)."""

    def prepare() -> None:
        # The replicas take SIGTERM the default way (the trainer installs its own handler).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if memory_limit_bytes:
            resource.setrlimit(resource.RLIMIT_DATA, (int(memory_limit_bytes), int(memory_limit_bytes)))

    return prepare


def supervise(attempt_dir: Path) -> int:
    launch = json.loads((attempt_dir / LAUNCH_FILE).read_text())
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # for the replicas; we keep waiting for them
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    children: dict[int, subprocess.Popen] = {}
    for replica in launch["replicas"]:
        rank = replica["rank"]
        with open(log_path(attempt_dir, rank), "ab") as log:
            children[rank] = subprocess.Popen(
                replica["argv"], cwd=launch["cwd"], env=replica["env"], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=_before_exec(replica.get("memory_limit_bytes")),
            )
    failure_grace_s = float(launch.get("failure_grace_s", 30))
    kill_at = None
    running = dict(children)
    while running:
        for rank, child in list(running.items()):
            code = child.poll()
            if code is None:
                continue
            del running[rank]
            _write_atomically(exit_path(attempt_dir, rank), str(code))
            if code not in EXIT_CODES_OK and kill_at is None:
                for other in running.values():
                    other.send_signal(signal.SIGTERM)
                kill_at = time.monotonic() + failure_grace_s
        if kill_at is not None and time.monotonic() >= kill_at:
            for other in running.values():
                other.kill()
        time.sleep(0.1)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    attempt_dir = Path(argv[0]).resolve()
    if os.fork():
        return 0  # the launcher's child returns at once; the grandchild carries on
    os.setsid()
    if os.fork():
        os._exit(0)
    _write_atomically(attempt_dir / PID_FILE, f"{os.getpid()} {os.getpgid(0)}")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        supervise(attempt_dir)
    finally:
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
