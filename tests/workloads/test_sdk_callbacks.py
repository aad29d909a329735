"""The Lightning and transformers callbacks: a tiny model trained in a subprocess, stopped by a SIGTERM mid-run,
then run again to resume at the exact step."""

import json
import signal
from pathlib import Path

import pytest

from runners.workloads import progress
from tests.workloads.script_runs import ScriptJob, python, run_script

pytestmark = pytest.mark.e2e

SCRIPTS = Path(__file__).with_name("scripts")


def steps_of(job_dir: Path, **where) -> list[int]:
    return [r["step"] for r in progress.read_metrics(job_dir) if all(r.get(k) == v for k, v in where.items())]


def stop_mid_run(job_dir: Path, script: str, returned: str) -> int:
    """Run until step 3 is reported, SIGTERM the job, check it checkpointed, the training call returned (`returned`
    is what the script prints then) and the script exited 0; the step it stopped at."""
    job = ScriptJob(job_dir, python(SCRIPTS / script))
    job.wait_for(lambda: (found := steps_of(job_dir)) and found[-1] >= 3, "step 3", timeout=300)
    job.signal(signal.SIGTERM)

    assert job.wait() == [0], job.logs()
    stopped = steps_of(job_dir)[-1]
    assert steps_of(job_dir) == list(range(1, stopped + 1))
    stop = progress.stop_of_attempt(job_dir, 0)
    assert stop is not None and stop["reason"] == "SIGTERM received", job.logs()
    assert stop["checkpoint_step"] == stopped == progress.latest_checkpoint_step(job_dir)
    assert [c["step"] for c in progress.read_checkpoints(job_dir)] == [stopped]
    assert f"{returned} at step {stopped}" in job.ranks[0].log(), "the script went on after training, to its end"
    return stopped


def resume(job_dir: Path, script: str, steps: int, **hyperparameters) -> ScriptJob:
    job = run_script(job_dir, python(SCRIPTS / script), attempt=1, hyperparameters=hyperparameters, timeout=300)
    assert job.wait() == [0], job.logs()
    return job


def test_lightning_stops_on_sigterm_with_a_checkpoint_and_resumes_at_the_step_after(tmp_path):
    pytest.importorskip("lightning")
    job_dir = tmp_path / "job"
    stopped = stop_mid_run(job_dir, "lightning_tiny.py", "fit returned")
    assert (job_dir / "checkpoints" / f"step-{stopped:08d}.ckpt").is_file()
    assert all("train_loss" in r for r in progress.read_metrics(job_dir)), "the logged metrics are reported"

    again = resume(job_dir, "lightning_tiny.py", stopped + 3, max_steps=stopped + 3)
    log = again.ranks[0].log()
    assert f"resuming from {stopped}" in log and f"fit returned at step {stopped + 3}" in log
    assert steps_of(job_dir, attempt=1) == [stopped + 1, stopped + 2, stopped + 3]
    assert [(c["step"], c["attempt"]) for c in progress.read_checkpoints(job_dir)] == [(stopped, 0), (stopped + 3, 1)]
    assert progress.stop_of_attempt(job_dir, 1) is None


def test_transformers_stops_on_sigterm_with_a_checkpoint_and_resumes_at_the_step_after(tmp_path):
    pytest.importorskip("transformers")
    job_dir = tmp_path / "job"
    stopped = stop_mid_run(job_dir, "transformers_tiny.py", "train returned")
    folder = job_dir / "checkpoints" / f"step-{stopped:08d}"
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == stopped
    assert not (job_dir / "hf-output" / f"checkpoint-{stopped}").exists(), "moved into the job's checkpoints"
    assert all("loss" in r and "learning_rate" in r for r in progress.read_metrics(job_dir))

    again = resume(job_dir, "transformers_tiny.py", stopped + 3, max_steps=stopped + 3)
    log = again.ranks[0].log()
    assert f"resuming from {stopped}" in log and f"train returned at step {stopped + 3}" in log
    assert steps_of(job_dir, attempt=1) == [stopped + 1, stopped + 2, stopped + 3]
    assert progress.stop_of_attempt(job_dir, 1) is None
