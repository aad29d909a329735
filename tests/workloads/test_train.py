"""The training workload as the local backend runs it: real processes, real gloo, real signals."""

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from runners.workloads import progress
from runners.workloads.progress import EXIT_CHECKPOINTED_ON_SIGNAL, EXIT_FAILED, EXIT_OK

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
# What the launcher sets; cleared so that a developer's shell can't change what a test runs.
LAUNCHER_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PORTAL_ATTEMPT"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Replica:
    """One rank of a job: its process and the log file its stdout goes to, as the portal does it."""

    def __init__(self, job_dir: Path, args, *, rank=0, world=1, port=None, attempt=0, env=None, **popen):
        self.log_path = job_dir.parent / f"{job_dir.name}-attempt{attempt}-rank{rank}.log"
        child_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TRAIN_")}
        child_env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), PORTAL_ATTEMPT=str(attempt))
        # One thread a rank, as the local backend gives a replica of one declared CPU: OpenMP threads
        # spinning for cores that a busy test machine does not have slow a step a hundredfold.
        child_env["OMP_NUM_THREADS"] = "1"
        if world > 1:
            child_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        child_env.update(env or {})
        command = [sys.executable, "-m", "runners.workloads.train", "--job-dir", str(job_dir), *map(str, args)]
        with open(self.log_path, "wb") as log:  # a file, not a pipe: a full pipe would stall the trainer
            self.proc = subprocess.Popen(
                command, cwd=REPO, env=child_env, stdout=log, stderr=subprocess.STDOUT, **popen
            )

    def wait(self, timeout=240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"rank did not finish in {timeout}s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_job(job_dir: Path, args, *, world=1, attempt=0, env=None, timeout=240) -> list[Replica]:
    port = free_port() if world > 1 else None
    replicas = [Replica(job_dir, args, rank=r, world=world, port=port, attempt=attempt, env=env) for r in range(world)]
    try:
        for replica in replicas:
            replica.wait(timeout)
    finally:
        for replica in replicas:
            replica.kill()
    return replicas


def assert_exit(replicas, code):
    for rank, replica in enumerate(replicas):
        assert replica.proc.returncode == code, f"rank {rank} exited {replica.proc.returncode}:\n{replica.log()[-3000:]}"


def steps_of(job_dir: Path, **where) -> list[int]:
    return [r["step"] for r in progress.read_metrics(job_dir) if all(r[k] == v for k, v in where.items())]


def wait_for_step(job_dir: Path, step: int, replicas, timeout=240) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reached = steps_of(job_dir)
        if reached and reached[-1] >= step:
            return reached[-1]
        if any(r.proc.poll() is not None for r in replicas):
            pytest.fail("a rank exited early:\n" + "\n".join(r.log()[-2000:] for r in replicas))
        time.sleep(0.05)
    pytest.fail(f"step {step} not reached in {timeout}s")


def mean(values):
    return sum(values) / len(values)


def test_one_process_trains_logs_and_checkpoints(tmp_path):
    job = tmp_path / "job"
    replicas = run_job(job, ["--steps", 30, "--checkpoint-every", 10])

    assert_exit(replicas, EXIT_OK)
    metrics = progress.read_metrics(job)
    assert [r["step"] for r in metrics] == list(range(1, 31))
    for record in metrics:
        assert set(record) == {"step", "loss", "samples_per_s", "time", "attempt"}
        assert record["attempt"] == 0 and record["samples_per_s"] > 0
        assert datetime.fromisoformat(record["time"]).utcoffset().total_seconds() == 0
    losses = [r["loss"] for r in metrics]
    assert mean(losses[-10:]) < mean(losses[:10]) - 0.5, losses

    checkpoints = progress.read_checkpoints(job)
    assert [c["step"] for c in checkpoints] == [10, 20, 30]
    for record in checkpoints:
        assert set(record) == {"step", "path", "bytes", "created_at", "attempt"} and record["attempt"] == 0
        path = job / record["path"]
        assert path.stat().st_size == record["bytes"] > 0
        datetime.fromisoformat(record["created_at"])
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == [
        "step-00000010.pt",
        "step-00000020.pt",
        "step-00000030.pt",
    ]
    assert progress.latest_checkpoint_step(job) == 30
    assert "finished all 30 steps" in replicas[0].log()


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    job = tmp_path / "job"
    assert_exit(run_job(job, ["--steps", 12, "--checkpoint-every", 2, "--keep-checkpoints", 2]), EXIT_OK)

    assert [c["step"] for c in progress.read_checkpoints(job)] == [2, 4, 6, 8, 10, 12]
    assert list(progress.checkpoint_files(job)) == [10, 12]


def test_two_ranks_finish_together(tmp_path):
    job = tmp_path / "job"
    replicas = run_job(job, ["--steps", 20, "--checkpoint-every", 10], world=2)

    assert_exit(replicas, EXIT_OK)
    assert steps_of(job) == list(range(1, 21))
    assert [c["step"] for c in progress.read_checkpoints(job)] == [10, 20]
    for rank, replica in enumerate(replicas):
        assert f"[rank {rank}/2] finished all 20 steps" in replica.log()
    assert "saved checkpoint" not in replicas[1].log()  # rank 0 alone writes


def test_sigterm_to_the_group_checkpoints_then_a_restart_resumes(tmp_path):
    job = tmp_path / "job"
    port = free_port()
    args = ["--steps", 100000, "--checkpoint-every", 100000]
    # Both ranks in one new process group, as a launcher would put a job, so one killpg reaches both.
    first = Replica(job, args, rank=0, world=2, port=port, process_group=0)
    second = Replica(job, args, rank=1, world=2, port=port, process_group=first.proc.pid)
    replicas = [first, second]
    try:
        wait_for_step(job, 5, replicas)
        os.killpg(first.proc.pid, signal.SIGTERM)
        for replica in replicas:
            replica.wait()
    finally:
        for replica in replicas:
            replica.kill()

    assert_exit(replicas, EXIT_CHECKPOINTED_ON_SIGNAL)
    reached = steps_of(job)[-1]
    assert reached >= 5 and steps_of(job) == list(range(1, reached + 1))
    assert progress.latest_checkpoint_step(job) == reached
    assert [c["step"] for c in progress.read_checkpoints(job)] == [reached]
    # Both got the signal; a rank whose handler ran only after that step's vote (it was inside the all_reduce)
    # stops at the same step for "another rank asked to stop". At least one rank stopped for the signal itself.
    logs = [replica.log() for replica in replicas]
    assert any("SIGTERM received" in text for text in logs), logs
    assert all("SIGTERM received" in text or "another rank asked to stop" in text for text in logs), logs

    again = run_job(job, ["--steps", reached + 5, "--checkpoint-every", 100000], world=2, attempt=1)

    assert_exit(again, EXIT_OK)
    for replica in again:
        assert f"resumed from step {reached}" in replica.log()
    assert steps_of(job, attempt=1) == list(range(reached + 1, reached + 6))
    assert steps_of(job) == list(range(1, reached + 6))
    assert progress.latest_checkpoint_step(job) == reached + 5
    assert [(c["step"], c["attempt"]) for c in progress.read_checkpoints(job)] == [(reached, 0), (reached + 5, 1)]
    _, logged = progress.parse_log(again[0].log())
    assert [(c["step"], c["attempt"]) for c in logged] == [(reached + 5, 1)], "the tagged line carries it too"


def test_a_signal_to_one_rank_stops_every_rank(tmp_path):
    job = tmp_path / "job"
    port = free_port()
    args = ["--steps", 100000, "--checkpoint-every", 100000]
    replicas = [Replica(job, args, rank=r, world=2, port=port) for r in range(2)]
    try:
        wait_for_step(job, 3, replicas)
        replicas[1].proc.send_signal(signal.SIGTERM)
        for replica in replicas:
            replica.wait()
    finally:
        for replica in replicas:
            replica.kill()

    assert_exit(replicas, EXIT_CHECKPOINTED_ON_SIGNAL)
    assert "another rank asked to stop" in replicas[0].log()
    assert progress.latest_checkpoint_step(job) == steps_of(job)[-1]


def test_a_damaged_newest_checkpoint_is_skipped_on_resume(tmp_path):
    job = tmp_path / "job"
    assert_exit(run_job(job, ["--steps", 20, "--checkpoint-every", 10]), EXIT_OK)
    newest = job / "checkpoints" / "step-00000020.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    stale_temp = job / "checkpoints" / ".step-00000030.pt.tmp-999999"
    stale_temp.write_bytes(b"half a checkpoint")
    with open(job / progress.METRICS_FILE, "a") as metrics:
        metrics.write('{"step": 21, "lo')  # as if the writer had been killed mid-line

    [replica] = run_job(job, ["--steps", 25, "--checkpoint-every", 10], attempt=1)

    assert_exit([replica], EXIT_OK)
    log = replica.log()
    assert "skipping checkpoint step-00000020.pt" in log
    assert "resumed from step 10" in log
    assert steps_of(job, attempt=1) == list(range(11, 26))  # the first line after the torn one survived
    assert [r["step"] for r in progress.latest_per_step(progress.read_metrics(job))] == list(range(1, 26))
    assert (job / "checkpoints" / "step-00000020.pt.corrupt").exists()  # set aside, not deleted
    assert not stale_temp.exists()
    assert list(progress.checkpoint_files(job)) == [10, 20, 25]


def test_max_runtime_stops_like_a_signal(tmp_path):
    job = tmp_path / "job"
    [replica] = run_job(job, ["--steps", 100000, "--checkpoint-every", 100000, "--max-runtime-s", 1])

    assert_exit([replica], EXIT_CHECKPOINTED_ON_SIGNAL)
    assert "--max-runtime-s 1 reached" in replica.log()
    assert progress.latest_checkpoint_step(job) == steps_of(job)[-1] > 0


def test_max_runtime_counts_from_the_first_step_not_from_the_start(tmp_path):
    # Rank 1 starts 5 s after rank 0, so rank 0 waits at the rendezvous for longer than its
    # --max-runtime-s: counted from the process's start it would stop after its first step.
    job = tmp_path / "job"
    port = free_port()
    args = ["--steps", 100000, "--checkpoint-every", 100000, "--max-runtime-s", 2]
    first = Replica(job, args, rank=0, world=2, port=port)
    replicas = [first]
    try:
        time.sleep(5)
        late = datetime.now(UTC)
        replicas.append(Replica(job, args, rank=1, world=2, port=port))
        for replica in replicas:
            replica.wait()
    finally:
        for replica in replicas:
            replica.kill()

    assert_exit(replicas, EXIT_CHECKPOINTED_ON_SIGNAL)
    (counted_from,) = [line for line in first.log().splitlines() if "--max-runtime-s 2 counts from now" in line]
    counted_from = datetime.fromisoformat(counted_from.split()[0])
    last = datetime.fromisoformat(progress.read_metrics(job)[-1]["time"])
    assert counted_from > late, "the clock starts once the rendezvous is done"
    # About 2 s of steps after the rendezvous (counted from the process's start it would have stopped
    # after its first step). Each rank keeps its own clock and either may stop both, and rank 0 logs
    # its line just after starting its clock: so "about" is within a tenth of a second.
    assert (last - counted_from).total_seconds() >= 1.9
    assert "--max-runtime-s 2 reached" in first.log() or "--max-runtime-s 2 reached" in replicas[1].log()


def test_configured_from_the_environment_alone(tmp_path):
    job = tmp_path / "job"
    env = {"TRAIN_JOB_DIR": str(job), "TRAIN_STEPS": "4", "TRAIN_CHECKPOINT_EVERY": "0", "TRAIN_BATCH_SIZE": "8"}
    replica = Replica(job, [], env=env)
    replica.proc.args = None
    # Replica always passes --job-dir; run the bare command here to show the variables suffice.
    replica.wait()
    child_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TRAIN_")}
    result = subprocess.run(
        [sys.executable, "-m", "runners.workloads.train"],
        cwd=REPO,
        env={**child_env, **env, "TRAIN_JOB_DIR": str(tmp_path / "bare")},
        capture_output=True,
        text=True,
        timeout=240,
    )

    assert result.returncode == EXIT_OK, result.stderr
    assert steps_of(tmp_path / "bare") == [1, 2, 3, 4]
    assert [c["step"] for c in progress.read_checkpoints(tmp_path / "bare")] == [4]  # 0: only at the end


def test_an_error_exits_1_with_the_traceback(tmp_path):
    job = tmp_path / "job"
    [replica] = run_job(job, ["--steps", 3, "--corpus", tmp_path / "missing.txt"])

    assert_exit([replica], EXIT_FAILED)
    assert "Traceback (most recent call last)" in replica.log()
    assert "FileNotFoundError" in replica.log()


def test_bad_arguments_exit_2(tmp_path):
    [replica] = run_job(tmp_path / "job", ["--steps", 0])

    assert_exit([replica], 2)
    assert "--steps" in replica.log()


# --- in-process, for what needs torch imported here --------------------------------------------


def test_flags_win_over_the_environment():
    pytest.importorskip("torch")
    from runners.workloads.train import parse_args

    environ = {"TRAIN_JOB_DIR": "/env", "TRAIN_STEPS": "7", "TRAIN_LR": "0.5", "PORTAL_ATTEMPT": "3"}
    args = parse_args(["--steps", "9"], environ)

    assert (args.job_dir, args.steps, args.lr, args.attempt, args.world_size) == (Path("/env"), 9, 0.5, 3, 1)
    with pytest.raises(SystemExit):
        parse_args([], {"TRAIN_JOB_DIR": "/env", "TRAIN_STEPS": "many"})
    with pytest.raises(SystemExit):
        parse_args([], {})  # no job folder


def test_each_rank_and_step_draws_its_own_batch_reproducibly():
    pytest.importorskip("torch")
    from runners.workloads.train import DEFAULT_CORPUS, batch_for, load_corpus

    data = load_corpus(DEFAULT_CORPUS, 64)

    def draw(rank, step):
        return batch_for(data, seed=0, rank=rank, step=step, batch_size=4, seq_len=64)

    inputs, targets = draw(0, 1)
    assert inputs.shape == targets.shape == (4, 64)
    assert (inputs[:, 1:] == targets[:, :-1]).all()  # targets are the next byte
    assert (draw(0, 1)[0] == inputs).all()
    assert not (draw(1, 1)[0] == inputs).all()
    assert not (draw(0, 2)[0] == inputs).all()


def test_the_model_is_small_and_the_exit_codes_are_re_exported():
    pytest.importorskip("torch")
    from runners.workloads import train

    parameters = sum(p.numel() for p in train.CharModel().parameters())
    assert 10_000 < parameters < 100_000
    assert train.EXIT_CHECKPOINTED_ON_SIGNAL == EXIT_CHECKPOINTED_ON_SIGNAL == 75
    assert train.EXIT_OK == 0 and train.EXIT_FAILED == 1
