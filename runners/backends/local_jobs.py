"""Jobs on the local backend: each attempt's replicas are real processes on this host.

One attempt lives in ``<jobs_dir>/<job id>/attempts/<n>/``: ``launch.json`` (what to run),
``supervisor.pid``, ``rank-<r>.log`` and ``rank-<r>.exit``. The job folder itself is the
trainer's (``metrics.jsonl``, ``checkpoints/``), shared by every attempt, so a relaunch
resumes from the newest checkpoint. `runners.workloads.supervise` starts the replicas in a
process group of their own and records their exit codes; nothing here waits for a process,
so a worker restart loses nothing and the status is read from the outside.

Only the shipped trainer runs here: a tenant never gets to run a command on the portal host,
and the environment variables it may set were checked by the portal (no ``PYTHON*``,
``LD_*`` or rendezvous names). Pure Python, no Django.
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

from runners.backends.base import AttemptStatus, JobLaunch, PermanentBackendError, TransientBackendError
from runners.workloads import progress, supervise

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
SUPERVISOR_MODULE = "runners.workloads.supervise"
TRAINER_MODULE = "runners.workloads.train"
# How long a launch waits for the detached supervisor to say it is up.
SUPERVISOR_START_TIMEOUT_S = 20.0
# Variables of the portal host a replica inherits; everything else it gets is set below.
INHERITED_VARIABLES = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _alive(pid: int) -> bool:
    """Whether this pid is a live supervisor of ours (not a zombie, not a reused pid)."""
    try:
        with open(f"/proc/{pid}/stat") as stream:
            state = stream.read().rsplit(")", 1)[1].split()[0]
        if state in ("Z", "X"):
            return False
        with open(f"/proc/{pid}/cmdline", "rb") as stream:
            return SUPERVISOR_MODULE.encode() in stream.read()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class LocalJobs:
    """The job half of the local backend; `LocalBackend` hands it its state file."""

    def __init__(self, *, jobs_dir: Path, state, real_gpu_nodes) -> None:
        self.jobs_dir = Path(jobs_dir)
        self._state = state  # LocalBackend._state: the cluster state file, locked
        self._real_gpu_nodes = real_gpu_nodes  # () -> names of nodes whose GPUs are this host's

    def job_dir(self, job_id: int) -> Path:
        return self.jobs_dir / str(job_id)

    def attempt_dir(self, job_id: int, attempt: int) -> Path:
        return self.job_dir(job_id) / "attempts" / str(attempt)

    def _supervisor(self, job_id: int, attempt: int) -> tuple[int, int] | None:
        try:
            pid, pgid = (self.attempt_dir(job_id, attempt) / supervise.PID_FILE).read_text().split()
        except (FileNotFoundError, ValueError):
            return None
        return int(pid), int(pgid)

    # --- launch ----------------------------------------------------------------

    def launch(self, launch: JobLaunch) -> int | None:
        if launch.template != "pytorch-ddp":
            raise PermanentBackendError(
                f"Template {launch.template!r} runs on the Kubernetes backend only; locally only pytorch-ddp runs."
            )
        attempt_dir = self.attempt_dir(launch.job_id, launch.attempt)
        if (attempt_dir / supervise.PID_FILE).exists():
            return json.loads((attempt_dir / supervise.LAUNCH_FILE).read_text()).get("resumed_from_step")
        with self._state(write=False) as state:
            down = set(state.get("down", []))
        lost = sorted({replica.node for replica in launch.replicas} & down)
        if lost:
            raise PermanentBackendError(f"Node {', '.join(lost)} is down.")
        job_dir = self.job_dir(launch.job_id)
        attempt_dir.mkdir(parents=True, exist_ok=True)
        resumed = progress.latest_checkpoint_step(job_dir)
        port = free_port()
        real_nodes = self._real_gpu_nodes()
        inherited = {name: os.environ[name] for name in INHERITED_VARIABLES if name in os.environ}
        # Each host's cores shared out between the replicas running on it.
        per_host = max(1, (os.cpu_count() or 1) // max(1, len(launch.replicas)))
        replicas = []
        for replica in launch.replicas:
            env = {
                **inherited,
                **dict(launch.env),
                "OMP_NUM_THREADS": str(per_host),
                "TRAIN_JOB_DIR": str(job_dir),
                "TRAIN_STEPS": str(launch.steps),
                "TRAIN_CHECKPOINT_EVERY": str(launch.checkpoint_every_steps),
                "TRAIN_MAX_RUNTIME_S": str(launch.max_runtime_s),
                "PORTAL_ATTEMPT": str(launch.attempt),
                "PORTAL_JOB": str(launch.job_id),
                "RANK": str(replica.rank),
                "WORLD_SIZE": str(len(launch.replicas)),
                "LOCAL_RANK": str(replica.rank),
                "LOCAL_WORLD_SIZE": str(len(launch.replicas)),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "PYTHONUNBUFFERED": "1",
            }
            if replica.node in real_nodes and replica.gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(index) for index in replica.gpus)
                env["LOCAL_RANK"] = "0"  # each rank sees only its own GPUs
            replicas.append({"rank": replica.rank, "argv": [sys.executable, "-m", TRAINER_MODULE], "env": env})
        record = {
            "job_id": launch.job_id, "attempt": launch.attempt, "cwd": str(REPO_ROOT), "replicas": replicas,
            "nodes": sorted({replica.node for replica in launch.replicas}), "resumed_from_step": resumed,
            "workload": launch.workload,
        }
        temp = attempt_dir / f".{supervise.LAUNCH_FILE}.tmp"
        temp.write_text(json.dumps(record, indent=2))
        os.replace(temp, attempt_dir / supervise.LAUNCH_FILE)
        with self._state(write=True) as state:
            for node in record["nodes"]:
                names = state["workloads"].setdefault(node, [])
                if launch.workload not in names:
                    names.append(launch.workload)
        try:
            subprocess.run(
                [sys.executable, "-m", SUPERVISOR_MODULE, str(attempt_dir)], cwd=REPO_ROOT, check=True, timeout=30,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            raise TransientBackendError(f"Could not start the supervisor: {exc}") from None
        deadline = time.monotonic() + SUPERVISOR_START_TIMEOUT_S
        while self._supervisor(launch.job_id, launch.attempt) is None:
            if time.monotonic() > deadline:
                raise TransientBackendError(f"The supervisor of job {launch.job_id} did not start.")
            time.sleep(0.05)
        return resumed

    # --- status ----------------------------------------------------------------

    def status(self, job_id: int, attempt: int) -> AttemptStatus:
        attempt_dir = self.attempt_dir(job_id, attempt)
        try:
            record = json.loads((attempt_dir / supervise.LAUNCH_FILE).read_text())
        except FileNotFoundError:
            return AttemptStatus("lost", reason="The attempt was never launched on this host.")
        ranks = [replica["rank"] for replica in record["replicas"]]
        codes = {}
        for rank in ranks:
            try:
                codes[rank] = int(supervise.exit_path(attempt_dir, rank).read_text())
            except (FileNotFoundError, ValueError):
                pass
        with self._state(write=False) as state:
            down = sorted(set(record["nodes"]) & set(state.get("down", [])))
        supervisor = self._supervisor(job_id, attempt)
        if down:
            if supervisor:
                _signal_group(supervisor[1], signal.SIGKILL)
            return AttemptStatus("lost", codes, f"Node {', '.join(down)} was lost.", node_lost=True)
        if len(codes) == len(ranks):
            return AttemptStatus("exited", codes)
        if supervisor and _alive(supervisor[0]):
            return AttemptStatus("running", codes)
        if supervisor is None:
            return AttemptStatus("running", codes, "Starting.")
        # The supervisor is gone without every exit code written: killed (SIGKILL to the group).
        _signal_group(supervisor[1], signal.SIGKILL)
        return AttemptStatus("lost", codes, "The job's processes were killed or vanished.")

    def stop(self, job_id: int, attempt: int) -> None:
        supervisor = self._supervisor(job_id, attempt)
        if supervisor and _alive(supervisor[0]):
            _signal_group(supervisor[1], signal.SIGTERM)

    def kill(self, job_id: int, attempt: int) -> None:
        supervisor = self._supervisor(job_id, attempt)
        if supervisor:
            _signal_group(supervisor[1], signal.SIGKILL)

    def forget(self, job_id: int, attempt: int) -> None:
        try:
            record = json.loads((self.attempt_dir(job_id, attempt) / supervise.LAUNCH_FILE).read_text())
        except FileNotFoundError:
            return
        with self._state(write=True) as state:
            for node in record["nodes"]:
                names = state["workloads"].get(node, [])
                if record["workload"] in names:
                    names.remove(record["workload"])
                if not names:
                    state["workloads"].pop(node, None)

    def attempts_on(self, node: str, workload: str | None = None) -> list[tuple[int, int]]:
        """(job id, attempt) of the launched attempts with a replica on the node."""
        found = []
        for launch_file in self.jobs_dir.glob(f"*/attempts/*/{supervise.LAUNCH_FILE}"):
            try:
                record = json.loads(launch_file.read_text())
            except (OSError, ValueError):
                continue
            if node in record.get("nodes", []) and workload in (None, record.get("workload")):
                found.append((record["job_id"], record["attempt"]))
        return found

    # --- what it wrote -----------------------------------------------------------

    def logs(self, job_id: int, attempt: int, rank: int, *, tail: int) -> str:
        path = supervise.log_path(self.attempt_dir(job_id, attempt), rank)
        try:
            with open(path, "rb") as stream:
                stream.seek(0, os.SEEK_END)
                size = stream.tell()
                stream.seek(max(0, size - 256 * 1024))
                lines = stream.read().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-tail:]) + ("\n" if lines else "")

    def metrics(self, job_id: int) -> list[dict]:
        return progress.read_metrics(self.job_dir(job_id))

    def checkpoints(self, job_id: int) -> list[dict]:
        return progress.read_checkpoints(self.job_dir(job_id))
