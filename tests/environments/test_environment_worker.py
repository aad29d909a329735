"""Provisioning with real Celery worker processes over Redis."""

import os

import pytest

from runners.environments.models import Environment
from tests.support.worker import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def _state(environment_id):
    return Environment.objects.get(id=environment_id).state


def test_a_real_worker_provisions_and_tears_down(celery_worker, client_for, owner, tenant, settings):
    client = client_for(owner)
    environment_id = client.post("/api/v1/environments/", {"tenant": "acme", "name": "train"}).json()["id"]
    wait_for(lambda: _state(environment_id) == "ready", message="the environment to become ready")
    assert (settings.LOCAL_WORKSPACE_DIR / "acme--train" / "environment.json").exists()
    assert client.delete(f"/api/v1/environments/{environment_id}/").status_code == 202
    wait_for(lambda: _state(environment_id) == "deleted", message="the environment to be deleted")
    assert not (settings.LOCAL_WORKSPACE_DIR / "acme--train").exists()


def test_a_task_whose_worker_was_killed_is_redelivered(celery_worker_factory, client_for, owner, tenant, settings):
    settings.LOCAL_PROVISION_DELAY_S = 4
    first = celery_worker_factory(CELERY_VISIBILITY_TIMEOUT_S=3, CELERY_UNACKED_RESTORE_INTERVAL_S=1)
    environment_id = client_for(owner).post("/api/v1/environments/", {"tenant": "acme", "name": "train"}).json()["id"]
    wait_for(lambda: _state(environment_id) == "provisioning", message="the first worker to start provisioning")
    first.kill()  # SIGKILL in the middle of ensure_environment: no ack was sent.
    environment = Environment.objects.get(id=environment_id)
    assert (environment.state, environment.task_runs) == ("provisioning", 1)

    # No beat runs here, so only the broker's redelivery can finish the job.
    second = celery_worker_factory(CELERY_VISIBILITY_TIMEOUT_S=3, CELERY_UNACKED_RESTORE_INTERVAL_S=1)
    wait_for(lambda: _state(environment_id) == "ready", timeout_s=60, message="the redelivered task to finish")
    environment.refresh_from_db()
    assert environment.task_runs >= 2, "the same task ran again on the second worker"
    assert "environment_provision" in second.output()
    assert Environment.objects.count() == 1
    workspaces = [p.name for p in settings.LOCAL_WORKSPACE_DIR.iterdir()]
    assert workspaces == ["acme--train"], "one workspace, no leftovers from the killed attempt"
    assert sorted(os.listdir(settings.LOCAL_WORKSPACE_DIR / "acme--train")) == [
        "checkpoints", "data", "environment.json", "jobs"
    ]
