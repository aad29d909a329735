"""A script job through the portal on the local backend: a real script using the SDK, from a stored bundle.

Preempted, it sees should_stop(), checkpoints and exits 0; the SDK's stop record makes that a stop
(requeued, resuming from the checkpoint), not the end of the job; the next attempt resumes there and
finishes. The services are the ones the Celery tasks call; the backend, its supervisors and the script
are real processes.
"""

import json

import pytest
from gpuportal import bundle as packing

from runners.bundles import services as bundles
from runners.clusters.registry import get_backend
from runners.jobs import reconcile
from runners.jobs import services as jobs
from runners.workloads import sandbox
from tests.support.jobs import admit_and_launch, job_data, preempt, reconcile_until
from tests.support.races import wait_until

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
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "train.py").write_text(SCRIPT)
    archive = tmp_path / "project.tar.gz"
    archive.write_bytes(packing.pack(folder))
    with archive.open("rb") as upload:
        return bundles.store(tenant, owner, upload)[0]


@pytest.mark.skipif(sandbox.unavailable() is not None, reason=f"no sandbox here: {sandbox.unavailable()}")
def test_a_preempted_script_that_stops_through_the_sdk_is_requeued_and_its_next_attempt_resumes_and_finishes(
    script_environment, stored, owner
):
    job = jobs.job_submit(actor=owner, data=job_data(
        script_environment, name="sdk-script", template="script", bundle=stored.sha256, command=["python", "train.py"],
        hyperparameters={"steps": 120, "pause_s": 0.1}, replicas=1, topology={"level": "none", "mode": "preferred"},
        memory_mib_per_replica=2048, max_runtime_s=600, max_retries=0, env={}))
    admit_and_launch(job)
    stored.refresh_from_db()
    assert stored.last_used_at is not None  # the bundle list says a job started from it

    def stepped():
        reconcile.jobs_reconcile_run()
        return job.metrics.filter(step__gte=3).exists()

    assert wait_until(stepped, timeout_s=120), get_backend().job_logs(job.id, 1, 0, tail=50)
    preempt(job)
    job = reconcile_until(job, {"queued"}, timeout_s=60, pause_s=0.2)
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
