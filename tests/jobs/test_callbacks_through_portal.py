"""The SDK's Lightning and transformers callbacks, each training a tiny model through the portal.

For each: the script (tests/workloads/scripts/) is packed into a bundle and uploaded through the bundles
API, a `script` job runs it through the jobs API on the local backend (in the sandbox), it is preempted once
mid-run, stops with the callback's checkpoint and exits 0, the portal records the stop and the checkpoint and
requeues the job; the next attempt resumes from that checkpoint at the exact step (the library's own step
counter, and the metrics the portal recorded, go on with no gap or repeat) and the job succeeds. The services
are the ones the Celery tasks call; the backend, its supervisors and the script are real processes.
"""

import shutil
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from gpuportal import bundle as packing

from runners.clusters.registry import get_backend
from runners.jobs import reconcile
from runners.jobs.models import Job
from runners.workloads import sandbox
from tests.support.jobs import admit_and_launch, job_data, preempt, reconcile_until
from tests.support.races import wait_until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db,
    pytest.mark.skipif(sandbox.unavailable() is not None, reason=f"no sandbox here: {sandbox.unavailable()}"),
]

SCRIPTS = Path(__file__).resolve().parents[1] / "workloads" / "scripts"
STEPS = 30  # the whole run; the preemption comes at step 2 or a little after (0.5 s a step until then)


def _bundle(api, script: str, tmp_path) -> str:
    """The script alone in a folder, as train.py, packed and uploaded; the bundle's digest."""
    folder = tmp_path / "project"
    folder.mkdir()
    shutil.copy(SCRIPTS / script, folder / "train.py")
    archive = SimpleUploadedFile("project.tar.gz", packing.pack(folder), "application/gzip")
    response = api.post("/api/v1/tenants/acme/bundles/", {"archive": archive}, format="multipart")
    assert response.status_code == 201, response.json()
    return response.json()["sha256"]


def _log(job, attempt: int) -> str:
    return get_backend().job_logs(job.id, attempt, 0, tail=200)


@pytest.mark.parametrize(
    "library, script, returned, kept_at_end",
    [
        # Lightning's callback saves at the end of training too; the transformers script saves only on a stop.
        ("lightning", "lightning_tiny.py", "fit returned", True),
        ("transformers", "transformers_tiny.py", "train returned", False),
    ],
)
def test_a_callback_trains_through_the_portal_is_preempted_once_and_resumes_at_the_exact_step(
    library, script, returned, kept_at_end, client_for, owner, script_environment, tmp_path
):
    pytest.importorskip(library)
    api = client_for(owner)
    submitted = api.post("/api/v1/jobs/", job_data(
        script_environment, name=f"{library}-tiny", template="script", bundle=_bundle(api, script, tmp_path),
        command=["python", "train.py"],
        # Slow steps until the preemption, so that it comes mid-run; full speed once resumed.
        hyperparameters={"max_steps": STEPS, "sleep_s": 0.5, "resumed_sleep_s": 0},
        replicas=1, topology={"level": "none", "mode": "preferred"}, memory_mib_per_replica=4096,
        max_runtime_s=600, max_retries=0, env={}), format="json")
    assert submitted.status_code == 201, submitted.json()
    job = Job.objects.get(id=submitted.json()["id"])
    admit_and_launch(job)

    def stepped():
        reconcile.jobs_reconcile_run()
        return job.metrics.filter(step__gte=2).exists()

    assert wait_until(stepped, timeout_s=180), _log(job, 1)
    preempt(job)
    job = reconcile_until(job, {"queued"}, timeout_s=90, pause_s=0.2)
    first = job.attempts.get(number=1)
    assert (first.outcome, first.exit_code) == ("preempted", 75), (first.reason, _log(job, 1))
    assert first.stop_recorded_at is not None
    checkpoint = job.checkpoints.get()
    stopped = checkpoint.step
    assert 2 <= stopped < STEPS and checkpoint.attempt == first
    assert f"resumes from step {stopped}" in job.reason
    assert f"{returned} at step {stopped}" in _log(job, 1), "the training call returned at the stop"

    job = reconcile_until(job, {"succeeded"}, timeout_s=180, pause_s=0.2)
    second = job.attempts.get(number=2)
    assert (second.outcome, second.resumed_from_step) == ("succeeded", stopped), second.reason
    log = _log(job, 2)
    assert f"resuming from {stopped}" in log
    assert f"training starts at step {stopped}" in log, log  # global_step, once the library restored the checkpoint
    assert f"{returned} at step {STEPS}" in log, log

    recorded = list(job.metrics.order_by("step", "attempt").values_list("step", "attempt"))
    assert recorded == [(step, 1 if step <= stopped else 2) for step in range(1, STEPS + 1)]
    expected = [(stopped, 1), (STEPS, 2)] if kept_at_end else [(stopped, 1)]
    assert list(job.checkpoints.order_by("step").values_list("step", "attempt__number")) == expected
    if library == "transformers":
        assert not job.metrics.filter(loss__isnull=True).exists(), "the Trainer's logged loss reaches the portal"
