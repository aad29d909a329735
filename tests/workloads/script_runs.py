"""A team's training script run as the local backend runs its replicas: one process per rank, in a process
group of their own, with the variables the launcher sets, stdout and stderr to a log file per rank.

For the SDK's tests, and for any test that runs a script through the same motions without the portal.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What a launcher sets; cleared so that a developer's shell can't change what a test runs.
LAUNCHER_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_env(job_dir: Path, *, rank: int, world: int, port: int | None, attempt: int, job_id: int = 1,
                 hyperparameters: dict | None = None, env: dict | None = None) -> dict[str, str]:
    """This process's variables less any a launcher sets, plus those the local backend gives a replica."""
    child = {k: v for k, v in os.environ.items()
             if k not in LAUNCHER_VARS and not k.startswith(("TRAIN_", "PORTAL_"))}
    child.update(
        TRAIN_JOB_DIR=str(job_dir), PORTAL_JOB=str(job_id), PORTAL_ATTEMPT=str(attempt), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), PYTHONUNBUFFERED="1",
        # One thread a rank, as the local backend gives a replica of one declared CPU.
        OMP_NUM_THREADS="1",
    )
    if port is not None:
        child.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if hyperparameters is not None:
        child["PORTAL_HYPERPARAMETERS"] = json.dumps(hyperparameters)
    child.update(env or {})
    return child


class Rank:
    """One rank's process and the log its output goes to (a file, not a pipe: a full pipe would stall it)."""

    def __init__(self, job_dir: Path, command: list[str], *, rank: int, world: int, port: int | None, attempt: int,
                 process_group: int, **launch) -> None:
        self.log_path = job_dir.parent / f"{job_dir.name}-attempt{attempt}-rank{rank}.log"
        env = launcher_env(job_dir, rank=rank, world=world, port=port, attempt=attempt, **launch)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         process_group=process_group)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class ScriptJob:
    """One attempt of a job: every rank of `command` started at once, in one new process group.

    Like the local backend, it makes the attempt's folder (<job dir>/attempts/<n>/), where the SDK then
    writes each rank's activity.
    """

    def __init__(self, job_dir: Path, command: list[str], *, world: int = 1, attempt: int = 0, **launch) -> None:
        self.job_dir = job_dir
        (job_dir / "attempts" / str(attempt)).mkdir(parents=True, exist_ok=True)
        port = free_port()  # MASTER_ADDR and MASTER_PORT even for one rank, as the local backend sets them
        self.ranks: list[Rank] = []
        for rank in range(world):
            group = 0 if rank == 0 else self.ranks[0].proc.pid
            self.ranks.append(Rank(job_dir, command, rank=rank, world=world, port=port, attempt=attempt,
                                   process_group=group, **launch))

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- rank {r}:\n{rank.log()[-tail:]}" for r, rank in enumerate(self.ranks))

    def wait(self, timeout: float = 240) -> list[int]:
        """Every rank's exit code; fails the test (killing them) if they are not all done in time."""
        deadline = time.monotonic() + timeout
        try:
            for rank in self.ranks:
                rank.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not finish in {timeout}s:\n{self.logs()}")
        finally:
            self.kill()
        return [rank.proc.returncode for rank in self.ranks]

    def signal(self, signum: int = signal.SIGTERM) -> None:
        """Signal the whole group, as the local backend stops an attempt."""
        os.killpg(self.ranks[0].proc.pid, signum)

    def wait_for(self, predicate, what: str, timeout: float = 240):
        """Poll until predicate() is truthy; fails if a rank exits first or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := predicate():
                return found
            if any(rank.proc.poll() is not None for rank in self.ranks):
                pytest.fail(f"a rank exited before {what}:\n{self.logs()}")
            time.sleep(0.05)
        pytest.fail(f"no {what} in {timeout}s:\n{self.logs()}")

    def kill(self) -> None:
        for rank in self.ranks:
            rank.kill()


def run_script(job_dir: Path, command: list[str], *, timeout: float = 240, **launch) -> ScriptJob:
    """Start a job and wait for every rank to end."""
    job = ScriptJob(job_dir, command, **launch)
    job.wait(timeout)
    return job


def python(*args) -> list[str]:
    return [sys.executable, *map(str, args)]
