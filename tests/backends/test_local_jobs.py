"""Jobs on the local backend: what a replica is started with, its memory bound, forget, and progress reads.

Real supervisors and trainers, started through LocalBackend as the portal's launch does.
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from runners.backends.base import (
    PROGRESS_READ_MAX_BYTES,
    JobLaunch,
    PermanentBackendError,
    ReplicaPlacement,
    TrainerSettings,
)
from runners.backends.local import LocalBackend
from runners.backends.local_jobs import HOST_VARIABLES, SCRATCH_DIR, SCRATCH_VARIABLES, TRAINER_MODULE
from runners.nvidia import names
from runners.workloads import progress, supervise
from runners.workloads.env_policy import TRAINER_MIN_MEMORY_MIB

pytestmark = pytest.mark.e2e

MIB = 1024 * 1024


@pytest.fixture
def backend(tmp_path) -> LocalBackend:
    return LocalBackend(workspace_dir=tmp_path / "workspaces", use_nvml=False, jobs_dir=tmp_path / "jobs")


def make_launch(**overrides) -> JobLaunch:
    values = dict(
        job_id=5, attempt=1, tenant_slug="acme", namespace="acme--train", name="llm", template="pytorch-ddp",
        replicas=(ReplicaPlacement(0, "sim-1", (0,)),), gpu_resource=names.GPU_RESOURCE, gpus_per_replica=1,
        cpu_milli_per_replica=1000, memory_mib_per_replica=4096, steps=100000, checkpoint_every_steps=100000,
        max_runtime_s=3600, env=(("DATASET_SPLIT", "train"),),
    )
    values.update(overrides)
    return JobLaunch(**values)


def wait_until(predicate, timeout=180.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"{what} not reached in {timeout}s")


def exited(backend, launch) -> dict | None:
    status = backend.job_status(launch.job_id, launch.attempt)
    return status.exit_codes if status.phase == "exited" else None


def replica_pids(backend, launch) -> list[int]:
    """The trainer processes of the attempt: its supervisor's process group, as /proc tells it."""
    _pid, pgid = backend.jobs._supervisor(launch.job_id, launch.attempt)
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if int(stat[2]) == pgid and stat[0] not in "ZX" and TRAINER_MODULE.encode() in cmdline:
            found.append(int(entry.name))
    return found


def log_of(backend, launch, rank=0) -> str:
    return backend.job_logs(launch.job_id, launch.attempt, rank, tail=60)


# --- what a replica is started with ---------------------------------------------------------


def test_a_replica_runs_on_flags_from_the_spec_in_its_own_folders_and_forget_kills_it(backend, monkeypatch):
    monkeypatch.setenv("PORTAL_SECRET_OF_THE_HOST", "do-not-pass")
    monkeypatch.setenv("HOME", "/root-of-the-host")
    monkeypatch.setenv("TMPDIR", "/tmp")
    trainer = TrainerSettings(lr=0.01, batch_size=8, seq_len=32, seed=4, keep_checkpoints=2)
    launch = make_launch(trainer=trainer, max_runtime_s=900, memory_mib_per_replica=1536)
    assert backend.launch_job(launch) is None

    attempt_dir = backend.jobs.attempt_dir(5, 1)
    record = json.loads((attempt_dir / supervise.LAUNCH_FILE).read_text())
    (replica,) = record["replicas"]
    assert replica["argv"][1:] == [
        "-m", TRAINER_MODULE, "--job-dir", str(backend.jobs.job_dir(5)), "--steps", "100000",
        "--checkpoint-every", "100000", "--max-runtime-s", "900",
        "--lr", "0.01", "--batch-size", "8", "--seq-len", "32", "--seed", "4", "--keep-checkpoints", "2",
    ]
    assert replica["memory_limit_bytes"] == 1536 * MIB
    env = replica["env"]
    assert env["DATASET_SPLIT"] == "train"
    assert not any(name.startswith("TRAIN_") for name in env), "the trainer gets its settings as flags"
    for name, folder in SCRATCH_VARIABLES.items():
        assert env[name] == str(attempt_dir / SCRATCH_DIR / folder)
        assert Path(env[name]).is_dir()
    launcher = {"OMP_NUM_THREADS", "OMP_WAIT_POLICY", "PORTAL_ATTEMPT", "PORTAL_JOB", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONUNBUFFERED"}
    assert set(env) <= set(HOST_VARIABLES) | set(SCRATCH_VARIABLES) | launcher | {"DATASET_SPLIT"}
    assert env["OMP_NUM_THREADS"] == "1", "no more threads than the replica's declared CPU"
    assert env["OMP_WAIT_POLICY"] == "PASSIVE", "idle threads sleep: the host's cores are shared"

    # The running process itself: that environment exactly, and the memory limit set before exec.
    wait_until(lambda: progress.read_metrics(backend.jobs.job_dir(5)), what="the first step")
    (pid,) = replica_pids(backend, launch)
    seen = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if item)
    assert seen == env
    limits = Path(f"/proc/{pid}/limits").read_text()
    (line,) = [line for line in limits.splitlines() if line.startswith("Max data size")]
    assert line.split()[3:5] == [str(1536 * MIB), str(1536 * MIB)], line

    backend.forget_job(5, 1)

    wait_until(lambda: not replica_pids(backend, launch), timeout=30, what="the replica's end")
    supervisor_pid, _ = backend.jobs._supervisor(5, 1)
    wait_until(lambda: not Path(f"/proc/{supervisor_pid}").exists()
               or Path(f"/proc/{supervisor_pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX",
               timeout=30, what="the supervisor's end")
    assert not (attempt_dir / SCRATCH_DIR).exists()
    assert backend.node_workloads("sim-1") == []
    backend.forget_job(5, 1)  # idempotent, and signals nothing now


def test_forget_kills_replicas_left_behind_by_a_supervisor_that_died_alone(backend):
    launch = make_launch()
    backend.launch_job(launch)
    wait_until(lambda: progress.read_metrics(backend.jobs.job_dir(5)), what="the first step")
    supervisor_pid, _ = backend.jobs._supervisor(5, 1)
    os.kill(supervisor_pid, signal.SIGKILL)  # the supervisor alone: its replica runs on
    assert len(replica_pids(backend, launch)) == 1

    backend.forget_job(5, 1)

    wait_until(lambda: not replica_pids(backend, launch), timeout=30, what="the replica's end")


def test_a_variable_the_policy_refuses_starts_nothing(backend):
    for name in ("TRAIN_BATCH_SIZE", "TORCHINDUCTOR_CACHE_DIR", "GLIBC_TUNABLES", "X\n"):
        with pytest.raises(PermanentBackendError, match="may not set"):
            backend.launch_job(make_launch(env=((name, "1"),)))
    assert not backend.jobs.attempt_dir(5, 1).exists()


# --- memory ---------------------------------------------------------------------------------


def test_the_trainer_at_its_defaults_runs_within_the_floor_and_records_its_attempt(backend):
    launch = make_launch(memory_mib_per_replica=TRAINER_MIN_MEMORY_MIB, steps=6, checkpoint_every_steps=3,
                         attempt=2)
    backend.launch_job(launch)

    codes = wait_until(lambda: exited(backend, launch), what="the end of the attempt")

    assert codes == {0: 0}, log_of(backend, launch)
    read = backend.job_progress(5, 2, {})
    assert [(r["step"], r["attempt"]) for r in read.metrics] == [(s, 2) for s in range(1, 7)]
    assert [(r["step"], r["attempt"]) for r in read.checkpoints] == [(3, 2), (6, 2)]


def test_a_replica_that_needs_more_memory_than_its_limit_fails_instead_of_growing(backend):
    # The portal's largest batch and sequence (1024 x 512) take 3.4 GiB (measured): far past the floor.
    launch = make_launch(memory_mib_per_replica=TRAINER_MIN_MEMORY_MIB, trainer=TrainerSettings(batch_size=1024,
                         seq_len=512))
    limit_kib = TRAINER_MIN_MEMORY_MIB * 1024
    backend.launch_job(launch)
    peak = {"VmData": 0, "RssAnon": 0}

    def ended():
        for pid in replica_pids(backend, launch):
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    key, _, value = line.partition(":")
                    if key in peak:
                        peak[key] = max(peak[key], int(value.split()[0]))
            except (OSError, ValueError):
                pass
        return exited(backend, launch)

    codes = wait_until(ended, what="the end of the attempt")

    assert codes == {0: 1}, log_of(backend, launch)
    assert "can't allocate memory" in log_of(backend, launch) or "MemoryError" in log_of(backend, launch)
    assert 0 < peak["RssAnon"] <= peak["VmData"] <= limit_kib, peak
    assert progress.read_metrics(backend.jobs.job_dir(5)) == [], "not one step was taken"


def test_below_the_floor_the_trainer_refuses_to_start_rather_than_risk_a_hang(backend):
    launch = make_launch(memory_mib_per_replica=TRAINER_MIN_MEMORY_MIB // 2, steps=3)
    backend.launch_job(launch)

    codes = wait_until(lambda: exited(backend, launch), what="the end of the attempt")

    assert codes == {0: 1}
    assert f"below the {TRAINER_MIN_MEMORY_MIB} MiB this trainer needs" in log_of(backend, launch)


# --- progress ---------------------------------------------------------------------------------


def _metric(step: int, attempt: int = 0) -> dict:
    return {"step": step, "loss": 1.5, "samples_per_s": 10.0, "time": "2025-01-01T00:00:00.000+00:00",
            "attempt": attempt}


def test_a_million_metric_lines_are_read_in_bounded_chunks_each_exactly_once(backend):
    job_dir = backend.jobs.job_dir(9)
    job_dir.mkdir(parents=True)
    lines = 1_000_000
    line = json.dumps(_metric(0)).replace('"step": 0', '"step": %d') + "\n"
    with open(job_dir / progress.METRICS_FILE, "w") as stream:
        stream.write("".join(line % step for step in range(1, lines + 1)))
    size = (job_dir / progress.METRICS_FILE).stat().st_size
    assert size > 10 * PROGRESS_READ_MAX_BYTES

    cursor, steps, calls = {}, [], 0
    while True:
        read = backend.job_progress(9, 0, cursor)
        assert read.bytes_read <= PROGRESS_READ_MAX_BYTES
        if not read.bytes_read:
            break
        steps.extend(record["step"] for record in read.metrics)
        cursor = read.cursor
        calls += 1
        assert calls < 100
    assert steps == list(range(1, lines + 1))
    assert cursor == {"checkpoints": 0, "stops": 0, "datasets": 0, "metrics": size}
    longest = max(len(json.dumps(_metric(step))) + 1 for step in (1, lines))
    assert -(-size // PROGRESS_READ_MAX_BYTES) <= calls <= -(-size // (PROGRESS_READ_MAX_BYTES - longest))


def test_a_read_takes_whole_lines_checkpoints_first_and_goes_on_across_attempts(backend):
    job_dir = backend.jobs.job_dir(9)
    job_dir.mkdir(parents=True)
    metrics, checkpoints = job_dir / progress.METRICS_FILE, job_dir / progress.CHECKPOINTS_FILE
    checkpoint = {"step": 2, "path": "checkpoints/step-00000002.pt", "bytes": 9, "created_at": "t", "attempt": 0}
    metrics.write_text(json.dumps(_metric(1)) + "\n" + json.dumps(_metric(2)) + "\n" + '{"step": 3, "lo')
    checkpoints.write_text(json.dumps(checkpoint) + "\n")

    first = backend.job_progress(9, 0, {})
    assert [r["step"] for r in first.metrics] == [1, 2] and first.checkpoints == [checkpoint]
    assert first.cursor == {"checkpoints": checkpoints.stat().st_size, "stops": 0, "datasets": 0,
                            "metrics": metrics.read_bytes().rindex(b"\n") + 1}
    assert first.bytes_read == first.cursor["checkpoints"] + first.cursor["metrics"]
    assert backend.job_progress(9, 0, first.cursor).bytes_read == 0, "a torn last line waits"

    with open(metrics, "a") as stream:  # the writer finishes its line; the next attempt goes on
        stream.write('ss": 1.0, "samples_per_s": 1.0, "time": "t", "attempt": 0}\n' + json.dumps(_metric(4, 1)) + "\n")
    second = backend.job_progress(9, 1, first.cursor)
    assert [(r["step"], r["attempt"]) for r in second.metrics] == [(3, 0), (4, 1)]
    assert second.checkpoints == []
    assert backend.job_progress(9, 1, second.cursor).bytes_read == 0


def test_checkpoint_records_take_the_budget_first_and_metrics_the_rest(backend, monkeypatch):
    import runners.backends.local_jobs as local_jobs

    monkeypatch.setattr(local_jobs, "PROGRESS_READ_MAX_BYTES", 1000)
    job_dir = backend.jobs.job_dir(9)
    job_dir.mkdir(parents=True)
    line = json.dumps({"step": 1, "path": "p", "bytes": 1, "created_at": "t", "attempt": 0}) + "\n"
    (job_dir / progress.CHECKPOINTS_FILE).write_text(line * 20)
    (job_dir / progress.METRICS_FILE).write_text(json.dumps(_metric(1)) + "\n")

    read = backend.job_progress(9, 0, {})
    assert read.bytes_read <= 1000 and len(read.checkpoints) == 1000 // len(line) and read.metrics == []
    cursor, total = read.cursor, len(read.checkpoints)
    while (read := backend.job_progress(9, 0, cursor)).bytes_read:
        total += len(read.checkpoints)
        cursor = read.cursor
        if read.metrics:
            break
    assert total == 20 and [r["step"] for r in read.metrics] == [1]


def test_jobs_open_changes_nothing_on_the_local_backend(backend, tmp_path):
    backend.jobs_open(set())
    backend.jobs_open({(1, 1)})
    assert not (tmp_path / "jobs").exists()
