"""What a Celery worker's start costs: CPU seconds of its main process, and seconds, until it says "ready.".

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/portal CELERY_BROKER_URL=redis://127.0.0.1:6379/7 \\
        .venv/bin/python bench/worker_start.py [--repeats 5]

Starts `celery -A portal worker --concurrency 1` (as the suite's harness does) `--repeats` times with
Django's system checks skipped (CELERY_SKIP_CHECKS=1, the portal's default) and as many times with them
run (CELERY_SKIP_CHECKS empty), alternating, and prints the median, least and most of each. The suite
starts about 190 workers, and the deployment one a pod.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def start(skip_checks: str, log: Path) -> tuple[float, float]:
    env = dict(os.environ, CELERY_QUEUE="bench-worker-start", CELERY_SKIP_CHECKS=skip_checks)
    log.write_bytes(b"")
    with log.open("ab") as stream:
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "portal", "worker", "-l", "INFO", "--concurrency", "1",
             "--without-gossip", "--without-mingle"],
            cwd=REPO, env=env, stdout=stream, stderr=subprocess.STDOUT, start_new_session=True,
        )
        began = time.monotonic()
        while b"ready." not in log.read_bytes():
            if process.poll() is not None:
                raise SystemExit(f"the worker exited early:\n{log.read_text()[-2000:]}")
            time.sleep(0.02)
        ready_s = time.monotonic() - began
        fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return cpu_s, ready_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows: dict[str, list[tuple[float, float]]] = {"1": [], "": []}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeats):
            for skip in rows:
                rows[skip].append(start(skip, Path(folder) / "worker.log"))
    for skip, label in (("", "checks run"), ("1", "checks skipped")):
        cpu = [row[0] for row in rows[skip]]
        ready = [row[1] for row in rows[skip]]
        print(f"{label:15} CPU to ready: median {statistics.median(cpu):.2f} s (least {min(cpu):.2f}, most {max(cpu):.2f}); "
              f"seconds to ready: median {statistics.median(ready):.2f}")


if __name__ == "__main__":
    main()
