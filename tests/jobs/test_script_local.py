"""A script job through the portal on the local backend: a real script using the SDK, from a stored bundle.

Preempted, it sees should_stop(), checkpoints and exits 0; the SDK's stop record makes that a stop
(requeued, resuming from the checkpoint), not the end of the job; the next attempt resumes there and
finishes. The services are the ones the Celery tasks call; the backend, its supervisors and the script
are real processes.
"""

import json

import pytest

from runners.clusters.registry import get_backend
from runners.workloads import sandbox
from tests.support.jobs import preempted_after_step, reconcile_until, script_bundle, script_job_launched

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]

SCRIPT = '''
import json, sys, time
from pathlib import Path

import gpuportal

ctx = gpuportal.init(metrics_interval_s=0)
settings = ctx.hyperparameters
start = ctx.resume_from.step if ctx.resume_from else 0
(ctx.job_dir / f"attempt-{ctx.attempt}.json").write_text(json.dumps({"resumed_from": start, "cwd": str(Path.cwd())}))


def save(step):
    folder = ctx.job_dir / f"state-{step}"
    folder.mkdir()
    (folder / "state.json").write_text(json.dumps({"step": step}))
    ctx.checkpoint(step, folder)


for step in range(start + 1, settings["steps"] + 1):
    with ctx.busy():
        time.sleep(settings["pause_s"])
    ctx.report(step, loss=1.0 / step)
    if ctx.should_stop():
        save(step)
        sys.exit(0)  # stopped on request, and says so only through the SDK's stop record
save(settings["steps"])
'''


@pytest.fixture
def stored(tenant, owner, tmp_path):
    return script_bundle(tenant, owner, tmp_path, SCRIPT)


@pytest.mark.skipif(sandbox.unavailable() is not None, reason=f"no sandbox here: {sandbox.unavailable()}")
def test_a_preempted_script_that_stops_through_the_sdk_is_requeued_and_its_next_attempt_resumes_and_finishes(
    script_environment, stored, owner
):
    job = script_job_launched(owner, script_environment, stored, name="sdk-script", steps=120)
    stored.refresh_from_db()
    assert stored.last_used_at is not None  # the bundle list says a job started from it
    job = preempted_after_step(job)
    first = job.attempts.get(number=1)
    assert (first.outcome, first.exit_code) == ("preempted", 75), first.reason
    assert first.stop_recorded_at is not None
    stopped_at = job.checkpoints.get().step
    assert f"resumes from step {stopped_at}" in job.reason and stopped_at < 120

    job = reconcile_until(job, {"succeeded"}, timeout_s=120, pause_s=0.2)
    second = job.attempts.get(number=2)
    assert (second.outcome, second.resumed_from_step) == ("succeeded", stopped_at)
    job_dir = get_backend().jobs.job_dir(job.id)
    assert json.loads((job_dir / "attempt-2.json").read_text())["resumed_from"] == stopped_at
    assert sorted(job.checkpoints.values_list("step", flat=True)) == [stopped_at, 120]
    assert job.metrics.filter(attempt=2).order_by("step").first().step == stopped_at + 1
