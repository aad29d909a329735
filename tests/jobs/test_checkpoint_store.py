"""The checkpoint store: a script's checkpoints copied in the background as chunks, durable once stored, read
back from the store when the job folder's copy is gone, kept by retention, and held under the tenant's
storage quota, concurrent saves included.

The checkpoints are written by the SDK's own `write_checkpoint` into the local backend's job folder and
recorded by the portal's progress read; the store's task (`checkpoint_store_run`) is run as a worker runs it.
"""

import os
import threading

import pytest
from django.db import connection
from gpuportal import write_checkpoint

from common.errors import Invalid
from quotas.models import TenantStorage
from runners.bundles.models import Bundle
from runners.clusters.registry import get_backend
from runners.jobs import attempts, checkpoint_store
from runners.jobs import services as jobs
from runners.jobs.models import Checkpoint, Job, JobEvent, JobMetric
from runners.scheduling import services as scheduling
from runners.storage import chunks
from tests.support.jobs import give_quota, job_data, play_launch, ready_environment

pytestmark = pytest.mark.integration

SHA = "cd" * 32
MIB = 1 << 20


@pytest.fixture(autouse=True)
def _store_in_tmp(settings, tmp_path):
    settings.DATA_STORAGE_URL = f"file://{tmp_path}/store"
    settings.DATA_STORAGE_OPTIONS = {}


def _running(owner, tenant, flavors, name="ckpt", **spec):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=8, max_priority=50)
    environment = tenant.environments.first() or ready_environment(actor=owner, tenant=tenant)
    Bundle.objects.get_or_create(tenant=tenant, sha256=SHA, defaults={"size_bytes": 2048, "unpacked_bytes": 8192,
                                                                       "files": 3})
    job = jobs.job_submit(actor=owner, data=job_data(environment, name=name, template="script", bundle=SHA,
                                                     command=["python", "train.py"], hyperparameters={}, **spec))
    scheduling.cycle_run()
    attempt = play_launch(job)
    return Job.objects.get(id=job.id), attempt, get_backend().jobs.job_dir(job.id)


def _save(job, attempt, job_dir, step, content: bytes, tmp_path, *, keep=100, loss=None):
    source = tmp_path / f"model-{job.id}-{step}.pt"
    source.write_bytes(content)
    write_checkpoint(job_dir, step, source, attempt=1, keep=keep)
    if loss is not None:
        JobMetric.objects.create(job=job, attempt=1, step=step, loss=loss)
    attempts.progress_record(Job.objects.get(id=job.id), attempt, get_backend())
    return Checkpoint.objects.get(job=job, step=step)


def _store(checkpoint):
    return checkpoint_store.checkpoint_store_run(checkpoint.id)


BASE = os.urandom(4 * MIB)


def _fine_tuned(step: int) -> bytes:
    """A frozen base and a small part that changes at every step."""
    return BASE + os.urandom(64 * 1024) + step.to_bytes(4, "big")


@pytest.mark.django_db
def test_a_checkpoint_is_pending_then_durable_once_its_chunks_are_stored(owner, tenant, flavors, tmp_path):
    job, attempt, job_dir = _running(owner, tenant, flavors)
    checkpoint = _save(job, attempt, job_dir, 10, _fine_tuned(10), tmp_path)
    assert checkpoint.store_state == "pending" and checkpoint.durable_at is None
    assert _store(checkpoint) == "durable"
    checkpoint.refresh_from_db()
    assert checkpoint.store_state == "durable" and checkpoint.durable_at is not None
    manifest = chunks.Manifest.from_json(checkpoint.manifest)
    assert manifest.bytes == checkpoint.bytes
    assert chunks.missing(checkpoint_store.checkpoint_blobs(), manifest) == []
    assert _store(checkpoint) == "not pending"  # a second message stores nothing twice


@pytest.mark.django_db
def test_later_checkpoints_of_a_frozen_base_add_only_what_changed(owner, tenant, flavors, tmp_path):
    job, attempt, job_dir = _running(owner, tenant, flavors)
    for step in (10, 20, 30):
        _store(_save(job, attempt, job_dir, step, _fine_tuned(step), tmp_path))
    rows = list(Checkpoint.objects.filter(job=job).order_by("step"))
    assert rows[0].stored_bytes == rows[0].bytes
    assert all(row.stored_bytes < 2 * chunks.MAX_CHUNK_BYTES for row in rows[1:])
    assert checkpoint_store.tenant_stored_bytes(tenant.id) == sum(row.stored_bytes for row in rows)


@pytest.mark.django_db
def test_the_checkpoint_is_read_from_the_store_once_the_job_folder_lost_it(owner, tenant, flavors, tmp_path):
    job, attempt, job_dir = _running(owner, tenant, flavors)
    content = _fine_tuned(40)
    checkpoint = _save(job, attempt, job_dir, 40, content, tmp_path)
    _store(checkpoint)
    checkpoint.refresh_from_db()
    with checkpoint_store.checkpoint_bytes(checkpoint) as handle:
        assert handle.read() == content  # the node's copy
    (job_dir / checkpoint.uri).unlink()
    with checkpoint_store.checkpoint_bytes(checkpoint) as handle:
        assert handle.read() == content  # joined from the store's chunks
    checkpoint_store.checkpoint_restore(checkpoint, job_dir / checkpoint.uri)
    assert (job_dir / checkpoint.uri).read_bytes() == content


@pytest.mark.django_db
def test_retention_keeps_the_newest_and_the_best_and_the_sweep_collects_the_rest(owner, tenant, flavors, tmp_path):
    job, attempt, job_dir = _running(owner, tenant, flavors,
                                     checkpoint_retention={"keep_newest": 1, "keep_best": 1})
    losses = {10: 3.0, 20: 0.5, 30: 2.0, 40: 1.0}
    for step, loss in losses.items():
        _store(_save(job, attempt, job_dir, step, os.urandom(600 * 1024), tmp_path, loss=loss))
    preview = checkpoint_store.retention_preview(tenant_id=tenant.id, job_id=job.id,
                                                 policy=checkpoint_store.job_policy(job, None))
    assert preview["jobs"] == [{"job": job.id, "name": job.name, "steps": [10, 30]}]
    before = checkpoint_store.tenant_stored_bytes(tenant.id)
    assert preview["bytes_freed"] == sum(c.stored_bytes for c in Checkpoint.objects.filter(step__in=[10, 30]))
    result = checkpoint_store.checkpoints_sweep_run()
    assert result["checkpoints_discarded"] == 2 and result["bytes_deleted"] == preview["bytes_freed"]
    states = dict(Checkpoint.objects.filter(job=job).values_list("step", "store_state"))
    assert states == {10: "discarded", 20: "durable", 30: "discarded", 40: "durable"}
    assert checkpoint_store.tenant_stored_bytes(tenant.id) == before - preview["bytes_freed"]
    kept = [chunk.sha256 for c in Checkpoint.objects.filter(store_state="durable")
            for chunk in chunks.Manifest.from_json(c.manifest).chunks]
    assert set(checkpoint_store.checkpoint_blobs().keys()) == set(kept)


@pytest.mark.django_db
def test_a_save_past_the_quota_applies_retention_first_then_fails_with_the_reason(owner, tenant, flavors, tmp_path):
    TenantStorage.objects.create(tenant=tenant, quota_gb="0.002", retention={"keep_newest": 1})  # 2 MB
    job, attempt, job_dir = _running(owner, tenant, flavors)
    # Each stored before the next is saved (the agent keeps up, so none is skipped as superseded).
    saved = []
    for step in (10, 20, 30):
        saved.append(_save(job, attempt, job_dir, step, os.urandom(600_000), tmp_path))
        assert _store(saved[-1]) == "durable"  # 1.8 MB in all, nothing applied yet
    saved.append(_save(job, attempt, job_dir, 40, os.urandom(600_000), tmp_path))
    # Step 40 would take it to 2.4 MB: retention discards steps 10 and 20 (the newest durable one, step 30,
    # stays while step 40 is not stored: the job may still have to resume from it), and step 40 fits.
    assert _store(saved[3]) == "durable"
    states = dict(Checkpoint.objects.filter(job=job).values_list("step", "store_state"))
    assert states == {10: "discarded", 20: "discarded", 30: "durable", 40: "durable"}
    second = saved[3]
    # One checkpoint past the whole quota cannot fit whatever retention frees: refused, said on the job.
    third = _save(job, attempt, job_dir, 50, os.urandom(2_500_000), tmp_path)
    assert _store(third) == "refused"
    third.refresh_from_db()
    assert third.store_state == "failed" and "quota" in third.store_reason
    assert JobEvent.objects.filter(job=job, reason__contains="checkpoint storage quota").exists()
    second.refresh_from_db()
    assert second.store_state == "durable"  # the newest durable checkpoint of a running job is never discarded


@pytest.mark.django_db(transaction=True)
def test_the_quota_holds_under_concurrent_saves(owner, tenant, flavors, tmp_path):
    """Eight saves of 0.9 MB each race against a 4 MB quota with no retention: exactly four are stored."""
    TenantStorage.objects.create(tenant=tenant, quota_gb="0.004")
    job, attempt, job_dir = _running(owner, tenant, flavors)
    saved = [_save(job, attempt, job_dir, step, os.urandom(900_000), tmp_path) for step in range(10, 90, 10)]
    # Each is claimed and cut into chunks as the task does; then all reserve their bytes at once.
    manifests = {checkpoint.id: chunks.split(job_dir / checkpoint.uri) for checkpoint in saved}
    Checkpoint.objects.filter(job=job).update(store_state="storing")
    barrier = threading.Barrier(len(saved))
    outcomes = {}

    def reserve(checkpoint):
        try:
            barrier.wait(timeout=30)
            checkpoint_store.checkpoint_reserve(checkpoint, manifests[checkpoint.id])
            outcomes[checkpoint.step] = "reserved"
        except checkpoint_store.StoreRefused:
            outcomes[checkpoint.step] = "refused"
        finally:
            connection.close()

    threads = [threading.Thread(target=reserve, args=(checkpoint,)) for checkpoint in saved]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(outcomes.values()) == ["refused"] * 4 + ["reserved"] * 4, outcomes
    assert checkpoint_store.tenant_stored_bytes(tenant.id) == 3_600_000


@pytest.mark.django_db
def test_a_job_spec_with_a_malformed_retention_is_refused_naming_the_field(owner, tenant, flavors):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=8, max_priority=50)
    environment = ready_environment(actor=owner, tenant=tenant)
    with pytest.raises(Invalid) as refused:
        jobs.job_submit(actor=owner, data=job_data(environment, checkpoint_retention={"keep_newest": -2}))
    assert refused.value.field == "checkpoint_retention.keep_newest"
