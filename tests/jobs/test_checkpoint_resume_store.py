"""Resume from the checkpoint store: a preempted script's checkpoint is stored, its file in the job folder is
deleted, and the next attempt resumes from the store's copy, at the exact step and with the exact bytes.

The script, the supervisor and the restore are real processes of the local backend; the store's task is
run as a worker runs it.
"""

import hashlib
import json

import pytest

from runners.clusters.registry import get_backend
from runners.jobs import checkpoint_store
from runners.workloads import sandbox
from runners.workloads.checkpoint_restore import RESTORE_RECORD
from tests.support.jobs import preempted_after_step, reconcile_until, script_bundle, script_job_launched

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]

# Saves a file checkpoint of about 300 KB (a zip, as torch.save writes), random bytes; on resume, says the step
# and the sha256 of the bytes it resumed from.
SCRIPT = '''
import hashlib, json, random, sys, time, zipfile

import gpuportal

ctx = gpuportal.init(metrics_interval_s=0)
settings = ctx.hyperparameters
point = ctx.resume_from
start = point.step if point else 0
resumed = hashlib.sha256(point.path.read_bytes()).hexdigest() if point else None
(ctx.job_dir / f"attempt-{ctx.attempt}.json").write_text(json.dumps({"resumed_from": start, "sha256": resumed}))


def save(step):
    path = ctx.job_dir / f"state-{step}.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("state/data/0", random.Random(step).randbytes(300_000))
    ctx.checkpoint(step, path)


for step in range(start + 1, settings["steps"] + 1):
    with ctx.busy():
        time.sleep(settings["pause_s"])
    ctx.report(step, loss=1.0 / step)
    if ctx.should_stop():
        save(step)
        sys.exit(0)
save(settings["steps"])
'''


@pytest.fixture(autouse=True)
def _store_in_tmp(settings, tmp_path):
    settings.DATA_STORAGE_URL = f"file://{tmp_path}/store"
    settings.DATA_STORAGE_OPTIONS = {}


@pytest.fixture
def stored(tenant, owner, tmp_path):
    return script_bundle(tenant, owner, tmp_path, SCRIPT)


@pytest.mark.skipif(sandbox.unavailable() is not None, reason=f"no sandbox here: {sandbox.unavailable()}")
def test_a_job_whose_folder_lost_its_stored_checkpoint_resumes_from_the_store_at_its_step_with_its_bytes(
    script_environment, stored, owner
):
    job = script_job_launched(owner, script_environment, stored, name="from-store", steps=80)
    backend = get_backend()
    job = preempted_after_step(job)
    checkpoint = job.checkpoints.get()
    # The store's task, as a worker runs it; then the job folder loses the file (a node's disk gone).
    assert checkpoint_store.checkpoint_store_run(checkpoint.id) == "durable"
    checkpoint.refresh_from_db()
    file = backend.jobs.job_dir(job.id) / checkpoint.uri
    written = hashlib.sha256(file.read_bytes()).hexdigest()
    assert checkpoint.manifest["sha256"] == written
    file.unlink()

    job = reconcile_until(job, {"succeeded"}, timeout_s=120, pause_s=0.2)
    second = job.attempts.get(number=2)
    assert (second.outcome, second.resumed_from_step) == ("succeeded", checkpoint.step), second.reason
    attempt_dir = backend.jobs.attempt_dir(job.id, 2)
    said = json.loads((backend.jobs.job_dir(job.id) / "attempt-2.json").read_text())
    assert said == {"resumed_from": checkpoint.step, "sha256": written}
    restore = json.loads((attempt_dir / RESTORE_RECORD).read_text())
    assert restore["restored"] and restore["why"] == "missing" and restore["bytes"] == checkpoint.bytes > 300_000
