"""A write that committed answers success when the broker is down; the sweeps send its work later."""

import pytest
from django.test import Client

from portal.middleware import DEGRADED_HEADER
from runners.environments import services as environments
from runners.environments.models import Environment
from tests.support.worker import clear_cache, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

UNREACHABLE = "redis://127.0.0.1:9/0"  # the discard port: nothing listens there


def _point_celery_at(url: str | None) -> None:
    """Send tasks to another broker URL (None: back to the configured one); workers are not affected."""
    from portal.celery import app

    # The write URL, since CELERY_BROKER_URL in the environment outranks app.conf.broker_url.
    app.conf.broker_write_url = url
    # Forget the pools built for the old URL (kombu keeps them, keyed by URL, for when it comes back).
    app._pool = None
    app.amqp._producer_pool = None


@pytest.fixture
def broker_down():
    _point_celery_at(UNREACHABLE)
    yield
    _point_celery_at(None)
    clear_cache()


def test_an_environment_request_answers_201_and_says_degraded(broker_down, client_for, owner, tenant):
    response = client_for(owner).post("/api/v1/environments/", {"tenant": "acme", "name": "train"})
    assert response.status_code == 201, response.content
    assert "broker-unreachable" in response[DEGRADED_HEADER]
    assert "environment_provision" in response[DEGRADED_HEADER]
    environment = Environment.objects.get()
    assert environment.state == "requested"
    # A client that retries is told the truth: it exists already.
    again = client_for(owner).post("/api/v1/environments/", {"tenant": "acme", "name": "train"})
    assert again.status_code == 400


def test_a_quota_patch_answers_200_and_is_saved(broker_down, client_for, staff, owner, tenant, inventory,
                                                flavor_factory):
    environment = environments.environment_request(actor=owner, tenant=tenant, name="train")
    Environment.objects.filter(id=environment.id).update(state="ready")
    flavor = flavor_factory()
    created = client_for(staff).post("/api/v1/quotas/", {"tenant": "acme", "flavor": flavor.name, "guaranteed": 0,
                                                         "max": 2})
    assert created.status_code == 201
    assert DEGRADED_HEADER in created
    patched = client_for(staff).patch(f"/api/v1/quotas/{created.json()['id']}/", {"max": 5})
    assert patched.status_code == 200
    assert patched.json()["max"] == 5
    environment.refresh_from_db()
    assert environment.sync_generation > environment.synced_generation
    assert not environment.sync_pending, "the failed send left no pending mark that would block the next one"


def test_a_delete_and_a_page_form_answer_success_too(broker_down, client_for, owner, tenant):
    environment = environments.environment_request(actor=owner, tenant=tenant, name="train")
    Environment.objects.filter(id=environment.id).update(state="ready")
    assert client_for(owner).delete(f"/api/v1/environments/{environment.id}/").status_code == 202
    page = Client()
    page.force_login(owner)
    response = page.post("/tenants/acme/environments/new/", {"name": "serve"})
    assert response.status_code in (200, 302)
    assert Environment.objects.filter(name="serve", state="requested").exists()


def test_readyz_says_what_is_wrong(broker_down, client):
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["checks"]["database"] == "ok"
    assert body["checks"]["broker"].startswith("unreachable")


def test_readyz_and_healthz_when_all_is_well(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json()["checks"] == {"database": "ok", "broker": "ok", "migrations": "ok"}


@pytest.mark.worker
def test_once_the_broker_is_back_the_sweep_sends_the_work(client_for, owner, tenant, celery_worker):
    _point_celery_at(UNREACHABLE)
    try:
        environment_id = client_for(owner).post("/api/v1/environments/", {"tenant": "acme", "name": "train"}).json()["id"]
    finally:
        _point_celery_at(None)
    assert Environment.objects.get(id=environment_id).state == "requested"
    assert environments.environment_sweep_run(stuck_after_s=0)["provision"] == [environment_id]
    wait_for(lambda: Environment.objects.get(id=environment_id).state == "ready", message="the swept environment")
