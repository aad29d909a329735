"""A replica that hangs (its processes stopped with SIGSTOP: the port still takes connections, nothing
answers): the edge leaves it for another replica, and the reconcile stops counting it ready."""

import os
import signal
import time

import pytest

from runners.clusters.registry import get_backend
from runners.inference import reconcile
from runners.inference.models import EndpointState, InferenceEndpoint
from runners.workloads import supervise
from tests.support.edge import EdgeProcess
from tests.support.endpoints import drive, ready_count, trained_job
from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def two_ready(settings, tenant, owner, client_for):
    """An endpoint of two replicas, both ready: real server processes on the local backend."""
    settings.PREEMPTION_GRACE_PERIOD_S = 20
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    environment = ready_environment(actor=owner, tenant=tenant)
    source = trained_job(actor=owner, environment=environment)
    created = client_for(owner).post("/api/v1/endpoints/", {
        "tenant": tenant.slug, "environment": environment.id, "name": "chat", "source": {"job": source.id},
        "flavor": "h100-80gb", "gpus_per_replica": 1, "min_replicas": 2, "max_replicas": 2, "warm_replicas": 0,
        "queue_limit": 64, "batch_token_budget": 4096, "max_batch_wait_ms": 5, "default_deadline_ms": 10000,
    }, format="json")
    assert created.status_code == 201, created.content
    endpoint = InferenceEndpoint.objects.get(id=created.json()["id"])
    return drive(endpoint, lambda e: ready_count(e) == 2 and e.state == EndpointState.READY)


def _process_group(replica) -> int:
    """The process group of the replica's supervisor, its server and the server's engine."""
    attempt = replica.job.attempts.get(ended_at__isnull=True)
    pid_file = get_backend().jobs.attempt_dir(replica.job_id, attempt.number) / supervise.PID_FILE
    return int(pid_file.read_text().split()[1])


@pytest.fixture
def edge(tmp_path):
    process = EdgeProcess(tmp_path / "edge.log", EDGE_TABLE_REFRESH_S=0.2).start()
    yield process
    process.stop()


def _generate(edge, token, endpoint, body):
    answer = edge.post(f"/serve/{endpoint.tenant.slug}/{endpoint.name}/v1/generate", body, token=token)
    return answer.status_code, answer.headers.get("X-Portal-Replica"), answer.content


def test_a_hung_replica_is_left_by_the_edge_and_stops_being_ready(two_ready, edge, owner):
    """Before the fix the router waited on the hung replica for the request's deadline plus 5 s and answered
    504, never trying the other; and the reconcile kept the hung replica ready (a /readyz timeout kept the
    old answer), so every request that picked it waited so. Now the edge, whose probes find the replica
    silent, sends the request to the other replica with what is left of its deadline (and leaves it out of
    rotation); and after two passes without an answer the reconcile marks it not ready."""
    from tenants.services import token_create

    endpoint = two_ready
    hung, healthy = endpoint.replicas.select_related("job").order_by("id")
    group = _process_group(hung)
    token = token_create(user=owner, name="hung")[1]
    time.sleep(1)  # the edge's table has read both replicas
    os.killpg(group, signal.SIGSTOP)
    try:
        status, served_by, content = _generate(edge, token, endpoint, {"prompt": "hello", "max_tokens": 8,
                                                                       "deadline_ms": 20000})
        assert (status, served_by) == (200, str(healthy.id)), content

        for _ in range(reconcile.MISSES_BEFORE_NOT_READY):
            reconcile.endpoints_reconcile_run()
        hung.refresh_from_db()
        healthy.refresh_from_db()
        assert not hung.ready and healthy.ready
        status, served_by, content = _generate(edge, token, endpoint, {"prompt": "hello", "max_tokens": 8})
        assert (status, served_by) == (200, str(healthy.id)), content
    finally:
        os.killpg(group, signal.SIGCONT)

    # Answering again, it is ready again at the next pass.
    reconcile.endpoints_reconcile_run()
    hung.refresh_from_db()
    assert hung.ready
