"""Scripts on the SDK run as the local backend runs a job's replicas: real processes, real signals, real kills."""

import signal
import time
from pathlib import Path

import pytest

from runners.workloads import progress
from runners.workloads.activity import activity_file, read_activity
from tests.workloads.script_runs import REPO, ScriptJob, python, run_script

pytestmark = pytest.mark.e2e

SCRIPTS = Path(__file__).with_name("scripts")
LOOP = python(SCRIPTS / "loop.py")


def steps_of(job_dir: Path, **where) -> list[int]:
    return [r["step"] for r in progress.read_metrics(job_dir) if all(r.get(k) == v for k, v in where.items())]


def reached(job_dir: Path, step: int):
    return lambda: (found := steps_of(job_dir)) and found[-1] >= step and found[-1]


def test_a_sigterm_makes_should_stop_true_and_the_script_checkpoints_and_exits_0_with_a_stop_line(tmp_path):
    job_dir = tmp_path / "job"
    job = ScriptJob(job_dir, LOOP, attempt=2)
    job.wait_for(reached(job_dir, 3), "step 3")
    job.signal(signal.SIGTERM)
    job.signal(signal.SIGTERM)  # a repeated SIGTERM changes nothing

    assert job.wait() == [0], job.logs()
    last = steps_of(job_dir)[-1]
    assert steps_of(job_dir) == list(range(1, last + 1))
    assert progress.latest_checkpoint_step(job_dir) == last
    stop = progress.stop_of_attempt(job_dir, 2)
    assert (stop["reason"], stop["rank"], stop["checkpoint_step"]) == ("SIGTERM received", 0, last)
    records = progress.parse_log_records(job.ranks[0].log())
    assert records.stops[-1] == stop and records.checkpoints == progress.read_checkpoints(job_dir)
    assert (job_dir / "chained").read_text() == "SIGTERM", "the script's own handler was called too"
    assert (job_dir / "on_stop").read_text() == "SIGTERM received", "the on_stop callback, from the handler"

    again = run_script(job_dir, LOOP, attempt=3, hyperparameters={"steps": last + 3})
    assert again.wait() == [0]
    assert f"resuming from {last}" in again.ranks[0].log()
    assert steps_of(job_dir, attempt=3) == [last + 1, last + 2, last + 3]
    assert progress.stop_of_attempt(job_dir, 3) is None, "this attempt finished: no stop line"


def test_max_runtime_stops_the_script_and_exit_stopped_leaves_with_75(tmp_path):
    job_dir = tmp_path / "job"
    job = run_script(job_dir, LOOP, hyperparameters={"exit_75": True}, env={"TRAIN_MAX_RUNTIME_S": "1"})

    assert job.wait() == [75], job.logs()
    assert "stopped at step" in job.ranks[0].log()
    assert progress.stop_of_attempt(job_dir, 0)["reason"] == "max runtime 1 s reached"
    assert (job_dir / "on_stop").read_text() == "max runtime 1 s reached", "the on_stop callback, from its timer"
    assert progress.latest_checkpoint_step(job_dir) == steps_of(job_dir)[-1]


def test_a_checkpoint_is_whole_or_absent_whenever_the_writer_is_killed(tmp_path):
    torch = pytest.importorskip("torch")
    job_dir = tmp_path / "job"
    for attempt in range(3):
        job = ScriptJob(job_dir, LOOP, attempt=attempt,
                        hyperparameters={"every": 1, "payload_mb": 16, "sleep_s": 0})
        already = len(progress.read_checkpoints(job_dir))
        job.wait_for(lambda: len(progress.read_checkpoints(job_dir)) >= already + 2, "two more checkpoints")
        job.signal(signal.SIGKILL)  # most likely in the middle of writing the next one
        job.wait()

    files = progress.checkpoint_files(job_dir)
    assert files
    for step, path in files.items():
        assert torch.load(path, weights_only=True)["step"] == step, f"{path.name} is not whole"
    for record in progress.read_checkpoints(job_dir):
        path = job_dir / record["path"]
        assert not path.exists() or path.stat().st_size == record["bytes"], "recorded only once whole"
    again = run_script(job_dir, LOOP, attempt=3, hyperparameters={"steps": max(files) + 1})
    assert f"resuming from {max(files)}" in again.ranks[0].log()


def test_a_script_that_hangs_reads_idle_while_one_that_computes_reads_busy(tmp_path):
    job_dir = tmp_path / "job"
    job = ScriptJob(job_dir, LOOP, hyperparameters={"hang_after": 400, "sleep_s": 0.02})
    path = activity_file(job_dir / "attempts" / "0", 0)
    try:
        job.wait_for(lambda: (found := read_activity(path, now=time.time())) and found["busy_fraction"] > 0.5,
                     "a busy reading while it computes")
        job.wait_for(reached(job_dir, 400), "the hang")
        job.wait_for(lambda: (found := read_activity(path, now=time.time())) and found["busy_fraction"] == 0.0,
                     "an idle reading while it hangs")
        assert job.ranks[0].proc.poll() is None, "alive all along"
    finally:
        job.kill()


def test_the_ddp_example_runs_two_ranks_and_resumes(tmp_path):
    job_dir = tmp_path / "job"
    example = python(REPO / "sdk" / "examples" / "ddp" / "train.py")
    job = run_script(job_dir, example, world=2, hyperparameters={"steps": 30, "checkpoint_every": 10})

    assert job.wait() == [0, 0], job.logs()
    first = progress.read_metrics(job_dir)
    assert first[0]["step"] == 1 and first[-1]["step"] == 30, "rate-limited, but the first and the last"
    assert first[-1]["loss"] < first[0]["loss"]
    assert [(c["step"], c["attempt"]) for c in progress.read_checkpoints(job_dir)] == [(10, 0), (20, 0), (30, 0)]
    for rank in (0, 1):
        assert activity_file(job_dir / "attempts" / "0", rank).exists()
    assert "PORTAL_METRIC" not in job.ranks[1].log(), "rank 0 alone writes"

    again = run_script(job_dir, example, world=2, attempt=1, hyperparameters={"steps": 35, "checkpoint_every": 10})
    assert again.wait() == [0, 0], again.logs()
    assert steps_of(job_dir, attempt=1)[0] == 31 and steps_of(job_dir, attempt=1)[-1] == 35
    assert progress.read_checkpoints(job_dir)[-1] | {"created_at": None, "bytes": None} == {
        "step": 35, "path": "checkpoints/step-00000035.pt", "attempt": 1, "created_at": None, "bytes": None}


def test_a_sigterm_to_one_ddp_rank_stops_both_at_the_same_step(tmp_path):
    job_dir = tmp_path / "job"
    example = python(REPO / "sdk" / "examples" / "ddp" / "train.py")
    job = ScriptJob(job_dir, example, world=2, hyperparameters={"steps": 10**9, "checkpoint_every": 10**9})
    job.wait_for(lambda: progress.read_metrics(job_dir), "a metrics line")
    job.ranks[1].proc.send_signal(signal.SIGTERM)

    assert job.wait() == [0, 0], job.logs()
    stop = progress.stop_of_attempt(job_dir, 0)
    assert stop["reason"] == "another rank asked to stop"
    assert stop["checkpoint_step"] == progress.latest_checkpoint_step(job_dir) == steps_of(job_dir)[-1]
