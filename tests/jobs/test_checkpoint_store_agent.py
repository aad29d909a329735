"""The checkpoint store's agent: a checkpoint a dead worker left storing is asked for again after its lease; one a
newer pending checkpoint supersedes, that retention would not keep, is skipped when the agent is behind; the
agent's CPU work runs at idle priority; and the pods' upload endpoint refuses what is not the job's.

Checkpoints are written by the SDK's `write_checkpoint` into the local backend's job folder and recorded by the
portal's progress read; the store's task is run as a worker runs it.
"""

import hashlib
import json
import os
import threading
from datetime import timedelta

import pytest
from django.core import signing
from django.utils import timezone
from gpuportal import write_checkpoint

from quotas.models import TenantStorage
from runners.bundles.models import Bundle
from runners.clusters.registry import get_backend
from runners.jobs import attempts, checkpoint_store, checkpoint_upload
from runners.jobs import services as jobs
from runners.jobs.models import Checkpoint, Job
from runners.scheduling import services as scheduling
from runners.storage import chunks
from tests.support.jobs import give_quota, job_data, play_launch, ready_environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

SHA = "ef" * 32


@pytest.fixture(autouse=True)
def _store_in_tmp(settings, tmp_path):
    settings.DATA_STORAGE_URL = f"file://{tmp_path}/store"
    settings.DATA_STORAGE_OPTIONS = {}
    settings.PORTAL_PUBLIC_URL = ""


@pytest.fixture
def running(owner, tenant, flavors):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=8, max_priority=50)
    environment = ready_environment(actor=owner, tenant=tenant)
    Bundle.objects.create(tenant=tenant, sha256=SHA, size_bytes=2048, unpacked_bytes=8192, files=3)
    job = jobs.job_submit(actor=owner, data=job_data(environment, name="agent", template="script", bundle=SHA,
                                                     command=["python", "train.py"], hyperparameters={}))
    scheduling.cycle_run()
    attempt = play_launch(job)
    return Job.objects.get(id=job.id), attempt, get_backend().jobs.job_dir(job.id)


def _save(running, step, tmp_path, content=None):
    job, attempt, job_dir = running
    source = tmp_path / f"model-{step}.pt"
    source.write_bytes(content if content is not None else os.urandom(400_000))
    write_checkpoint(job_dir, step, source, attempt=1, keep=100)
    attempts.progress_record(Job.objects.get(id=job.id), attempt, get_backend())
    return Checkpoint.objects.get(job=job, step=step)


# --- stuck uploads ----------------------------------------------------------------------------------


def test_a_checkpoint_a_killed_worker_left_storing_is_asked_again_after_its_lease_and_then_stored(running, tmp_path):
    checkpoint = _save(running, 10, tmp_path)
    # A worker claimed it, reserved its chunks and died mid-upload: storing, a manifest, a lease run out.
    manifest = chunks.split(running[2] / checkpoint.uri)
    Checkpoint.objects.filter(id=checkpoint.id).update(
        store_state="storing", manifest=manifest.to_json(), stored_bytes=manifest.bytes,
        store_lease_until=timezone.now() - timedelta(seconds=1))
    held = _save(running, 20, tmp_path)
    Checkpoint.objects.filter(id=held.id).update(  # another worker still at it: its lease runs
        store_state="storing", store_lease_until=timezone.now() + timedelta(minutes=5))
    assert checkpoint_store.checkpoints_stuck_release() == [checkpoint.id]
    checkpoint.refresh_from_db()
    assert (checkpoint.store_state, checkpoint.manifest, checkpoint.stored_bytes) == ("pending", None, 0)
    assert Checkpoint.objects.get(id=held.id).store_state == "storing"
    # The task the sweep sends for it stores it whole.
    assert checkpoint_store.checkpoint_store_run(checkpoint.id) == "durable"
    checkpoint.refresh_from_db()
    assert checkpoint.manifest == manifest.to_json() and checkpoint.store_lease_until is None


@pytest.mark.django_db(transaction=True)  # the renewing thread has a connection of its own
def test_the_sweep_releases_a_stuck_checkpoint_and_a_worker_renews_its_lease_while_it_works(running, tmp_path, settings):
    checkpoint = _save(running, 10, tmp_path)
    Checkpoint.objects.filter(id=checkpoint.id).update(store_state="storing", store_lease_until=None)
    checkpoint_store.checkpoints_sweep_run()
    assert Checkpoint.objects.get(id=checkpoint.id).store_state == "pending"

    settings.CHECKPOINT_STORE_LEASE_S = 0.3  # renewed every 0.1 s
    Checkpoint.objects.filter(id=checkpoint.id).update(store_state="storing",
                                                       store_lease_until=checkpoint_store.lease_until())
    seen = []
    with checkpoint_store._LeaseRenewed(checkpoint.id):
        first = Checkpoint.objects.get(id=checkpoint.id).store_lease_until
        deadline = timezone.now() + timedelta(seconds=5)
        while timezone.now() < deadline and not seen:
            if Checkpoint.objects.get(id=checkpoint.id).store_lease_until > first:
                seen.append(True)
    assert seen, "the lease was renewed while the work went on"


def test_a_worker_that_lost_its_lease_does_not_record_the_checkpoint_durable(running, tmp_path):
    checkpoint = _save(running, 10, tmp_path)
    manifest = chunks.split(running[2] / checkpoint.uri)
    Checkpoint.objects.filter(id=checkpoint.id).update(store_state="pending")  # released by the sweep meanwhile
    assert checkpoint_store.checkpoint_seal(checkpoint.id, manifest) in ("lost", "incomplete")
    assert Checkpoint.objects.get(id=checkpoint.id).store_state == "pending"


# --- coalescing -------------------------------------------------------------------------------------


def test_a_behind_agent_skips_a_superseded_checkpoint_retention_would_not_keep(running, tmp_path, tenant):
    TenantStorage.objects.create(tenant=tenant, retention={"keep_newest": 1, "keep_every": 3})
    saved = {step: _save(running, step, tmp_path) for step in (10, 20, 30, 40)}
    assert checkpoint_store.checkpoint_store_run(saved[10].id) == "skipped"
    assert checkpoint_store.checkpoint_store_run(saved[30].id) == "durable", "keep_every 3 keeps the third"
    assert checkpoint_store.checkpoint_store_run(saved[40].id) == "durable", "the newest: nothing supersedes it"
    assert checkpoint_store.checkpoint_store_run(saved[20].id) == "skipped", "newer ones are stored already"
    states = dict(Checkpoint.objects.filter(job=running[0]).values_list("step", "store_state"))
    assert states == {10: "skipped", 20: "skipped", 30: "durable", 40: "durable"}
    assert "step 40" in Checkpoint.objects.get(id=saved[20].id).store_reason


def test_with_a_policy_that_keeps_everything_nothing_is_skipped(running, tmp_path):
    saved = [_save(running, step, tmp_path) for step in (10, 20)]
    assert checkpoint_store.checkpoint_store_run(saved[0].id) == "durable"


# --- the agent's priority ---------------------------------------------------------------------------


def test_the_agents_work_runs_in_a_thread_of_its_own_at_idle_priority(settings):
    settings.CHECKPOINT_STORE_PRIORITY = "idle"

    def where():
        thread = threading.get_native_id()
        return thread, os.getpriority(os.PRIO_PROCESS, thread), os.sched_getscheduler(thread)

    thread, nice, policy = checkpoint_store.at_low_priority(where)
    assert thread != threading.get_native_id()
    assert nice == 19 and policy == os.SCHED_IDLE
    assert os.sched_getscheduler(0) != os.SCHED_IDLE, "the worker's own thread keeps its priority"
    with pytest.raises(ZeroDivisionError):
        checkpoint_store.at_low_priority(lambda: 1 / 0)


# --- the pods' upload endpoint: what it refuses -----------------------------------------------------


def _url(job, attempt) -> str:
    return checkpoint_upload.signed_upload_url(job, attempt)


def _post(client, url, checkpoint, manifest):
    body = {"step": checkpoint.step, "path": checkpoint.uri, "manifest": manifest.to_json()}
    return client.post(url, data=json.dumps(body), content_type="application/json")


def test_the_upload_endpoint_stores_only_named_chunks_that_hash_to_their_keys(running, tmp_path, client):
    job, attempt, job_dir = running
    checkpoint = _save(running, 10, tmp_path)
    Checkpoint.objects.filter(id=checkpoint.id).update(store_state="")  # as Kubernetes leaves it
    manifest = chunks.split(job_dir / checkpoint.uri)
    url = _url(job, attempt)
    answer = _post(client, url, checkpoint, manifest)
    assert answer.status_code == 200 and answer.json()["state"] == "storing"
    missing = answer.json()["missing"]
    assert set(missing) == {chunk.sha256 for chunk in manifest.chunks}
    data = (job_dir / checkpoint.uri).read_bytes()
    first = manifest.chunks[0]
    # Bytes that are not the key's: 400. A chunk no checkpoint being stored names: 404.
    # The first byte flipped: the chunk is random, so a fixed first byte would be the chunk's own one time in 256.
    wrong = client.put(f"{url}chunks/{first.sha256}", data=bytes([data[0] ^ 0xFF]) + data[1:first.bytes],
                       content_type="application/octet-stream")
    assert wrong.status_code == 400
    stray = b"not a chunk of it"
    assert client.put(f"{url}chunks/{hashlib.sha256(stray).hexdigest()}", data=stray,
                      content_type="application/octet-stream").status_code == 404
    offset = 0
    for chunk in manifest.chunks:
        response = client.put(f"{url}chunks/{chunk.sha256}", data=data[offset:offset + chunk.bytes],
                              content_type="application/octet-stream")
        assert response.status_code == 204
        offset += chunk.bytes
    answer = _post(client, url, checkpoint, manifest)
    assert answer.json() == {"step": 10, "state": "durable", "reason": "", "missing": []}
    checkpoint.refresh_from_db()
    assert checkpoint.manifest == manifest.to_json() and checkpoint.durable_at is not None


def test_the_upload_endpoint_refuses_a_forged_or_expired_token_and_an_unrecorded_step(running, tmp_path, client):
    job, attempt, job_dir = running
    checkpoint = _save(running, 10, tmp_path)
    manifest = chunks.split(job_dir / checkpoint.uri)
    url = _url(job, attempt)
    forged = url.replace("/upload/", "/upload/x")
    assert _post(client, forged, checkpoint, manifest).status_code == 404
    token = signing.Signer(salt=checkpoint_upload.SALT).sign_object({"job": job.id, "attempt": 1, "until": 1})
    assert _post(client, f"/checkpoints/upload/{token}/", checkpoint, manifest).status_code == 410
    other = signing.Signer(salt=checkpoint_upload.SALT).sign_object(
        {"job": job.id, "attempt": 9, "until": 2**40})
    assert _post(client, f"/checkpoints/upload/{other}/", checkpoint, manifest).status_code == 404
    Checkpoint.objects.filter(id=checkpoint.id).delete()
    assert _post(client, url, checkpoint, manifest).status_code == 409


def test_an_upload_past_the_quota_fails_with_the_reason(running, tmp_path, client, tenant):
    TenantStorage.objects.create(tenant=tenant, quota_gb="0.0001")  # 100 kB
    job, attempt, job_dir = running
    checkpoint = _save(running, 10, tmp_path)
    answer = _post(client, _url(job, attempt), checkpoint, chunks.split(job_dir / checkpoint.uri)).json()
    assert answer["state"] == "failed" and "quota" in answer["reason"] and answer["missing"] == []
