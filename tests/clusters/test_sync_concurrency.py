"""Tenants and environments never block each other; re-syncs coalesce (PostgreSQL, real commits)."""

import json
import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
import redis
from django.conf import settings as django_settings
from django.db import connection, connections

from runners.clusters.registry import get_backend
from runners.environments import services as environments
from runners.environments.models import Environment
from tenants import services

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def ready_environments(tenant, owner):
    def make(*names):
        made = []
        for name in names:
            environment = environments.environment_request(actor=owner, tenant=tenant, name=name)
            assert environments.environment_provision_run(environment_id=environment.id) == "ready"
            made.append(environment)
        return made

    return make


def _in_thread(target) -> threading.Thread:
    def run():
        try:
            target()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_for_lease(environment_id: int, timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while not Environment.objects.filter(id=environment_id, sync_lease_until__isnull=False).exists():
        assert time.monotonic() < deadline, "the sync never started"
        time.sleep(0.02)


def test_an_environment_is_created_in_under_a_second_while_its_tenants_others_sync(
    ready_environments, client_for, owner, tenant, settings
):
    syncing, other = ready_environments("syncing", "other")
    settings.LOCAL_PROVISION_DELAY_S = 4  # every backend apply now takes 4 s
    get_backend.cache_clear()
    threads = [_in_thread(lambda e=e: environments.environment_sync_run(environment_id=e.id)) for e in (syncing, other)]
    _wait_for_lease(syncing.id)
    _wait_for_lease(other.id)
    time.sleep(0.2)  # both are inside the backend call now
    with connection.cursor() as cursor:
        # No lock is held across the backend call: not on the tenant, not on the environments.
        cursor.execute("SET lock_timeout = '200ms'")
        cursor.execute("SELECT id FROM tenants_tenant WHERE id = %s FOR UPDATE NOWAIT", [tenant.id])
        cursor.execute("SELECT id FROM runners_environment WHERE id IN (%s, %s) FOR UPDATE NOWAIT", [syncing.id, other.id])
    started = time.monotonic()
    response = client_for(owner).post("/api/v1/environments/", {"tenant": "acme", "name": "fresh"})
    elapsed = time.monotonic() - started
    for thread in threads:
        thread.join(timeout=30)
    print(f"environment created in {elapsed:.3f} s while two environments of its tenant synced (4 s each)")
    assert response.status_code == 201, response.content
    assert elapsed < 1.0


def _queued_syncs(environment_ids: set[int]) -> Counter:
    """environment_sync messages waiting in this run's queue, per environment."""
    client = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
    counts: Counter = Counter()
    for raw in client.lrange(django_settings.CELERY_TASK_DEFAULT_QUEUE, 0, -1):
        headers = json.loads(raw)["headers"]
        if headers["task"] == "runners.tasks.environment_sync":
            environment_id = int(headers["argsrepr"].strip("(),"))
            if environment_id in environment_ids:
                counts[environment_id] += 1
    return counts


def test_two_hundred_quota_changes_leave_at_most_one_pending_sync_per_environment(
    ready_environments, client_for, staff, tenant, inventory, flavor_factory, settings, own_queue
):
    ready = ready_environments("a", "b", "c")
    ids = {environment.id for environment in ready}
    flavor = flavor_factory()
    admin = client_for(staff)
    quota_id = admin.post(
        "/api/v1/quotas/", {"tenant": "acme", "flavor": flavor.name, "guaranteed": 0, "max": 1}
    ).json()["id"]
    for value in range(2, 201):
        assert admin.patch(f"/api/v1/quotas/{quota_id}/", {"max": value}).status_code == 200
    counts = _queued_syncs(ids)
    print(f"200 quota changes queued {dict(counts)} sync messages for environments {sorted(ids)}")
    assert set(counts) == ids, "every environment still gets its sync"
    assert max(counts.values()) == 1

    # The one sync per environment applies the newest quota.
    for environment in ready:
        assert environments.environment_sync_run(environment_id=environment.id)
        record = json.loads((settings.LOCAL_WORKSPACE_DIR / environment.namespace / "environment.json").read_text())
        assert record["quota_hard"] == {"requests.nvidia.com/gpu": 200}
        environment.refresh_from_db()
        assert environment.synced_generation == environment.sync_generation
        assert not environment.sync_pending


def test_a_change_while_a_sync_applies_is_applied_by_the_lease_holder(ready_environments, tenant, make_user, owner,
                                                                       settings):
    from tenants.models import Membership

    (environment,) = ready_environments("train")
    settings.LOCAL_PROVISION_DELAY_S = 1
    get_backend.cache_clear()
    results = []
    thread = _in_thread(lambda: results.append(environments.environment_sync_run(environment_id=environment.id)))
    _wait_for_lease(environment.id)
    # A second sync while the first holds the lease leaves the work to the holder...
    assert environments.environment_sync_run(environment_id=environment.id) is False
    # ...which sees the change made while it applied and applies again.
    services.membership_add(actor=owner, tenant=tenant, username=make_user("nina").username, role="viewer")
    thread.join(timeout=30)
    assert results == [True]
    record = json.loads((settings.LOCAL_WORKSPACE_DIR / environment.namespace / "environment.json").read_text())
    assert {"username": "nina", "role": "viewer"} in record["members"]
    environment.refresh_from_db()
    assert environment.synced_generation == environment.sync_generation
    assert environment.sync_lease_until is None
    assert Membership.objects.filter(tenant=tenant).count() == 2


def test_a_lost_sync_is_sent_again_by_the_sweep(ready_environments, tenant, owner, make_user):
    (environment,) = ready_environments("train")
    services.membership_add(actor=owner, tenant=tenant, username=make_user("nina").username, role="viewer")
    # Its message was lost: nothing pending, the change older than the cutoff.
    Environment.objects.filter(id=environment.id).update(sync_pending=False)
    assert environments.environment_sweep_run(stuck_after_s=3600)["sync"] == []
    requested_at = Environment.objects.get(id=environment.id).sync_requested_at
    Environment.objects.filter(id=environment.id).update(sync_requested_at=requested_at - timedelta(hours=2))
    assert environments.environment_sweep_run(stuck_after_s=3600)["sync"] == [environment.id]
    assert environments.environment_sweep_run(stuck_after_s=3600)["sync"] == [], "touched, so not sent twice"
