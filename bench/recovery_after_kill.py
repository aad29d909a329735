"""Recovery after a worker SIGKILLed mid-launch while Redis is down and comes back empty, over many trials.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/portal CELERY_BROKER_URL=redis://127.0.0.1:6379/0 \\
        .venv/bin/python bench/recovery_after_kill.py [--trials 10] [--lease-s 15] [--down-s 5]

Runs tests/faults/test_recovery_after_kill.py (two workers and a beat on a Redis of its own; the
worker holding the launch is SIGKILLed, Redis is down --down-s seconds and comes back empty) once
per trial, with the launch lease --lease-s (JOB_LAUNCH_LEASE_S, 15 s by default as in production),
and prints each trial's seconds from the SIGKILL to the job running, how late the surviving worker
was consuming again after Redis came back, then the smallest, the median and the largest.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIGURE = re.compile(r"([\d.]+)s from the SIGKILL to running .*connected again (-?[\d.]+|nan)s after")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--lease-s", type=float, default=15)
    parser.add_argument("--down-s", type=float, default=5)
    args = parser.parse_args()
    env = dict(os.environ, FAULTS_RECOVERY_LEASE_S=str(args.lease_s), FAULTS_RECOVERY_DOWN_S=str(args.down_s),
               API_LOGIN_RATE=os.environ.get("API_LOGIN_RATE", "10000/min"))
    figures, failures = [], 0
    for trial in range(1, args.trials + 1):
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-n", "0", "-q", "-s", "-p", "no:cacheprovider",
             "tests/faults/test_recovery_after_kill.py"],
            cwd=REPO, env=env, capture_output=True, text=True,
        )
        match = FIGURE.search(run.stdout)
        if run.returncode != 0 or not match:
            failures += 1
            print(f"trial {trial}: FAILED\n{run.stdout[-3000:]}{run.stderr[-2000:]}", flush=True)
            continue
        figures.append(float(match.group(1)))
        print(f"trial {trial}: {match.group(1)} s to running; the surviving worker consuming {match.group(2)} s "
              f"after Redis was back", flush=True)
    if figures:
        print(f"lease {args.lease_s:g} s, Redis down {args.down_s:g} s, {len(figures)} trials: "
              f"min {min(figures):.1f} s, median {statistics.median(figures):.1f} s, max {max(figures):.1f} s"
              f"{f'; {failures} failed' if failures else ''}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
