"""The edge's tests: an endpoint of real replicas (the shipped server on the local backend) and the edge
as a real process in front of it."""

import pytest
from rest_framework.test import APIClient

from runners.inference.models import EndpointState, InferenceEndpoint
from tests.support.edge import EdgeProcess
from tests.support.endpoints import drive, ready_count, trained_job
from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment

REFRESH_S = 0.2
# Long enough for the edge's table to have read what the test just changed.
SETTLE_S = 4 * REFRESH_S


def token_for(user) -> str:
    from tenants.services import token_create

    return token_create(user=user, name="edge test")[1]


@pytest.fixture
def serving(settings, tenant, owner):
    """Returns make(replicas, **spec): the endpoint acme/chat with that many ready replicas."""
    settings.PREEMPTION_GRACE_PERIOD_S = 20
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    environment = ready_environment(actor=owner, tenant=tenant)
    source = trained_job(actor=owner, environment=environment)

    def make(replicas: int, **spec) -> InferenceEndpoint:
        api = APIClient()
        api.credentials(HTTP_AUTHORIZATION=f"Token {token_for(owner)}")
        created = api.post("/api/v1/endpoints/", {
            "tenant": tenant.slug, "environment": environment.id, "name": "chat", "source": {"job": source.id},
            "flavor": "h100-80gb", "gpus_per_replica": 1, "min_replicas": replicas, "max_replicas": replicas,
            "warm_replicas": 0, "queue_limit": 64, "batch_token_budget": 4096, "max_batch_wait_ms": 5,
            "default_deadline_ms": 10000, **spec}, format="json")
        assert created.status_code == 201, created.content
        endpoint = InferenceEndpoint.objects.get(id=created.json()["id"])
        return drive(endpoint, lambda e: ready_count(e) == replicas and e.state == EndpointState.READY)

    return make


@pytest.fixture
def edge(tmp_path):
    process = EdgeProcess(tmp_path / "edge.log", EDGE_TABLE_REFRESH_S=REFRESH_S, EDGE_AUTH_CACHE_S=1).start()
    yield process
    assert process.stop() in (0, -15), process.output()[-3000:]  # uvicorn ends by the signal it shut down for
