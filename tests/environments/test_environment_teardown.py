"""Teardown on Kubernetes asks for the namespace to go and comes back later; no worker waits for it."""

import pytest

from runners.environments import services as environments
from runners.environments.models import Environment
from runners.environments.tasks import teardown_countdown_s
from tests.support.worker import wait_for

pytestmark = pytest.mark.e2e


def _deletes(standin, namespace):
    return [r for r in standin.requests if r.method == "DELETE" and r.path == f"/api/v1/namespaces/{namespace}"]


@pytest.fixture
def ready_environment(kubernetes_cluster, owner, tenant):
    environment = environments.environment_request(actor=owner, tenant=tenant, name="train")
    assert environments.environment_provision_run(environment_id=environment.id) == "ready"
    environment.refresh_from_db()
    return environment


@pytest.mark.django_db
def test_teardown_says_not_yet_while_the_namespace_terminates_then_deleted(kubernetes_cluster, ready_environment, owner):
    kubernetes_cluster.termination_delay_s = 60
    environments.environment_delete(actor=owner, environment=ready_environment)
    assert environments.environment_teardown_run(environment_id=ready_environment.id) == "deleting"
    assert environments.environment_teardown_run(environment_id=ready_environment.id) == "deleting"
    environment = Environment.objects.get(id=ready_environment.id)
    assert environment.state == "deleting"
    assert environment.status_message == f"Deleting: waiting for namespace {environment.namespace} to go."
    assert environment.task_runs == 3, "provision, then two teardown runs"
    assert len(_deletes(kubernetes_cluster, environment.namespace)) == 1

    kubernetes_cluster.finish_termination(environment.namespace)
    assert environments.environment_teardown_run(environment_id=ready_environment.id) == "deleted"
    environment.refresh_from_db()
    assert (environment.state, environment.status_message) == ("deleted", "Deleted.")
    assert kubernetes_cluster.objects() == {}


@pytest.mark.django_db
def test_a_namespace_stuck_terminating_is_reported_and_teardown_keeps_trying(kubernetes_cluster, ready_environment, owner, settings):
    settings.KUBERNETES_NAMESPACE_DELETE_TIMEOUT_S = 1
    kubernetes_cluster.termination_delay_s = float("inf")  # A finalizer that never finishes.
    environments.environment_delete(actor=owner, environment=ready_environment)
    Environment.objects.filter(id=ready_environment.id).update(
        delete_requested_at=ready_environment.created_at.replace(year=ready_environment.created_at.year - 1)
    )
    assert environments.environment_teardown_run(environment_id=ready_environment.id) == "deleting"
    environment = Environment.objects.get(id=ready_environment.id)
    assert "a finalizer may be stuck" in environment.status_message
    assert f"kubectl get namespace {environment.namespace} -o yaml" in environment.status_message
    kubernetes_cluster.finish_termination(environment.namespace)
    assert environments.environment_teardown_run(environment_id=ready_environment.id) == "deleted"


def test_the_countdown_between_looks_grows_and_is_capped():
    assert [teardown_countdown_s(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_a_real_worker_retries_teardown_until_the_namespace_is_gone(kubernetes_cluster, celery_worker, client_for, owner, tenant):
    kubernetes_cluster.termination_delay_s = 3
    client = client_for(owner)
    environment_id = client.post("/api/v1/environments/", {"tenant": "acme", "name": "train"}).json()["id"]
    wait_for(lambda: Environment.objects.get(id=environment_id).state == "ready", message="the environment to be ready")
    assert client.delete(f"/api/v1/environments/{environment_id}/").status_code == 202
    wait_for(lambda: Environment.objects.get(id=environment_id).state == "deleted", timeout_s=60,
             message="the teardown to finish")
    environment = Environment.objects.get(id=environment_id)
    assert environment.task_runs >= 3, "provision once, then teardown looked more than once"
    assert len(_deletes(kubernetes_cluster, environment.namespace)) == 1
    assert "Retry in" in celery_worker.output(), "the worker re-sent the teardown with a countdown"
    assert kubernetes_cluster.objects() == {}
