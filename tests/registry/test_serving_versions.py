"""Endpoints serve model versions, with real replicas on the local backend: an endpoint deployed from a job's
checkpoint (a promotion plus a deploy) keeps serving, and starts new replicas, once the job's checkpoints are
collected and the job is deleted; a rollout moves its replicas to another version, each replica saying which."""

import json

import pytest
from django.utils import timezone

from runners.clusters.registry import get_backend
from runners.inference.models import EndpointState, InferenceEndpoint
from runners.jobs.models import Job
from runners.registry.models import ModelVersion
from tests.support.edge import running_edge, through_edge
from tests.support.endpoints import drive, ready_count, trained_job
from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def _edge(tmp_path):
    """Requests for endpoints go through the edge (runners/edge/), a real process as in production."""
    with running_edge(tmp_path) as edge:
        yield edge


def generate(client, endpoint) -> int:
    answer = through_edge(client, f"/serve/{endpoint.tenant.slug}/{endpoint.name}/v1/generate",
                          json.dumps({"prompt": "hello", "max_tokens": 4}).encode())
    return answer.status_code


def test_an_endpoint_serving_a_version_survives_its_jobs_deletion_and_rolls_out_to_another_version(
        settings, tmp_path, tenant, owner, client_for):
    settings.DATA_STORAGE_URL = f"file://{tmp_path / 'store'}"
    settings.PREEMPTION_GRACE_PERIOD_S = 20
    get_backend.cache_clear()
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    environment = ready_environment(actor=owner, tenant=tenant)
    job = trained_job(actor=owner, environment=environment, step=10)
    client = client_for(owner)
    created = client.post("/api/v1/endpoints/", {
        "tenant": "acme", "environment": environment.id, "name": "chat", "source": {"job": job.id},
        "flavor": "h100-80gb", "min_replicas": 1, "max_replicas": 2}, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["model"] == {"name": "chat", "version": 1}
    endpoint = drive(InferenceEndpoint.objects.get(id=created.json()["id"]), lambda e: e.state == EndpointState.READY)
    assert generate(client, endpoint) == 200

    # The job's checkpoints are collected (files gone, marked deleted) and the job itself deleted.
    checkpoint = job.checkpoints.get()
    (get_backend().jobs.job_dir(job.id) / checkpoint.uri).unlink()
    job.checkpoints.update(deleted_at=timezone.now())
    Job.objects.filter(id=job.id).delete()
    endpoint.refresh_from_db()
    assert endpoint.source_job_id is None and endpoint.model_version.lineage["job"]["id"] == job.id
    assert generate(client, endpoint) == 200
    # A replica started now still has its weights: the version's own copy in the store.
    assert client.post(f"/api/v1/endpoints/{endpoint.id}/scale/", {"min_replicas": 2, "max_replicas": 2},
                       format="json").status_code == 202
    endpoint = drive(endpoint, lambda e: ready_count(e) == 2 and e.state == EndpointState.READY)
    assert generate(client, endpoint) == 200

    # A rollout to version 2 of the model (another job's checkpoint, promoted through the registry's API).
    newer = trained_job(actor=owner, environment=environment, name="newer", seed=1, step=20)
    promoted = client.post("/api/v1/tenants/acme/models/", {"name": "chat", "job": newer.id}, format="json")
    assert promoted.status_code == 201 and promoted.json()["version"] == 2
    rolled = client.post(f"/api/v1/endpoints/{endpoint.id}/rollout/", {"source": {"model": "chat", "version": 2}},
                         format="json")
    assert rolled.status_code == 202, rolled.json()
    endpoint = drive(endpoint, lambda e: e.state == EndpointState.READY and ready_count(e) == 2 and all(
        r.model_version.version == 2 for r in e.replicas.filter(ready=True, retiring=False)), timeout_s=120)
    detail = client.get(f"/api/v1/endpoints/{endpoint.id}/").json()
    assert detail["model"] == {"name": "chat", "version": 2}
    assert {r["model"]["version"] for r in detail["replicas"] if r["ready"] and not r["retiring"]} == {2}
    assert generate(client, endpoint) == 200
    client.force_login(owner)
    page = client.get(f"/endpoints/{endpoint.id}/live/")
    assert page.status_code == 200 and b"chat v2" in page.content
    assert ModelVersion.objects.filter(tenant=tenant, name="chat").count() == 2
