"""Provisioning and teardown of environments, through the services the tasks call."""

import json

import pytest
from django.utils import timezone

from runners.clusters.registry import get_backend
from runners.environments import services as environments
from runners.environments.models import Environment
from tenants import services
from tenants.models import Membership
from tests.support.backends import FailingBackend, SomethingHappensWhileBuilding, use_backend

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def environment(tenant, owner):
    return Environment.objects.create(
        tenant=tenant, name="train", namespace="acme-train", backend="local", created_by=owner
    )


def test_it_provisions_a_local_workspace_with_members(environment, settings, teammate):
    assert environments.environment_provision_run(environment_id=environment.id) == "ready"
    environment.refresh_from_db()
    assert (environment.state, environment.status_message, environment.task_runs) == ("ready", "Ready.", 1)
    record = json.loads((settings.LOCAL_WORKSPACE_DIR / "acme-train" / "environment.json").read_text())
    assert record["namespace"] == "acme-train"
    assert record["members"] == [{"username": "olivia", "role": "owner"}, {"username": "tom", "role": "member"}]


def test_provisioning_again_changes_nothing(environment, settings):
    environments.environment_provision_run(environment_id=environment.id)
    path = settings.LOCAL_WORKSPACE_DIR / "acme-train" / "environment.json"
    first = path.read_text(), path.stat().st_mtime_ns
    Environment.objects.filter(id=environment.id).update(state="provisioning")  # as after a redelivery
    assert environments.environment_provision_run(environment_id=environment.id) == "ready"
    assert (path.read_text(), path.stat().st_mtime_ns) == first


def test_a_ready_environment_is_left_alone_by_a_late_duplicate(environment):
    environments.environment_provision_run(environment_id=environment.id)
    assert environments.environment_provision_run(environment_id=environment.id) == "ready"
    environment.refresh_from_db()
    assert environment.task_runs == 1


def test_a_permanent_error_fails_it_with_the_reason(environment, settings):
    use_backend(settings, "refusing_for_good")
    assert environments.environment_provision_run(environment_id=environment.id) == "failed"
    environment.refresh_from_db()
    assert environment.state == "failed"
    assert "webhook denied" in environment.status_message


def test_a_transient_error_is_retried_then_gives_up(environment, settings):
    from runners.environments import tasks as environment_tasks

    use_backend(settings, "unreachable")
    settings.CELERY_TASK_ALWAYS_EAGER = True
    from portal.celery import app

    app.conf.task_always_eager = True
    try:
        environment_tasks.environment_provision.apply(args=[environment.id])
    finally:
        app.conf.task_always_eager = False
    environment.refresh_from_db()
    assert FailingBackend.calls == environment_tasks.ENVIRONMENT_MAX_RETRIES + 1
    assert environment.state == "failed"
    assert "connection refused" in environment.status_message


def test_teardown_removes_the_workspace(environment, settings):
    environments.environment_provision_run(environment_id=environment.id)
    environments.environment_delete(actor=environment.created_by, environment=environment)
    assert environments.environment_teardown_run(environment_id=environment.id) == "deleted"
    environment.refresh_from_db()
    assert environment.state == "deleted"
    assert not (settings.LOCAL_WORKSPACE_DIR / "acme-train").exists()
    assert environments.environment_teardown_run(environment_id=environment.id) == "deleted"


def test_an_environment_deleted_mid_provisioning_leaves_nothing_behind(environment, settings):
    use_backend(settings, "deleted_while_building")
    assert environments.environment_provision_run(environment_id=environment.id) == "deleted"
    assert not (settings.LOCAL_WORKSPACE_DIR / "acme-train").exists()


def test_the_sweep_reenqueues_only_stuck_environments(environment, tenant, django_capture_on_commit_callbacks):
    fresh = Environment.objects.create(tenant=tenant, name="fresh", namespace="acme-fresh", backend="local")
    gone = Environment.objects.create(
        tenant=tenant, name="gone", namespace="acme-gone", backend="local", state="deleting"
    )
    old = timezone.now() - timezone.timedelta(seconds=600)
    Environment.objects.filter(id__in=[environment.id, gone.id]).update(state_changed_at=old)
    found = environments.environment_sweep_run(stuck_after_s=120)
    assert found == {"provision": [environment.id], "teardown": [gone.id], "sync": []}
    assert fresh.id not in found["provision"]
    assert environments.environment_sweep_run(stuck_after_s=120) == {"provision": [], "teardown": [], "sync": []}


def test_a_membership_change_resyncs_ready_environments(environment, owner, make_user, settings):
    environments.environment_provision_run(environment_id=environment.id)
    make_user("nina")
    services.membership_add(actor=owner, tenant=environment.tenant, username="nina", role="viewer")
    assert environments.environment_sync_run(environment_id=environment.id)
    record = json.loads((settings.LOCAL_WORKSPACE_DIR / "acme-train" / "environment.json").read_text())
    assert {"username": "nina", "role": "viewer"} in record["members"]
    assert Membership.objects.filter(tenant=environment.tenant).count() == 2


def test_a_member_removed_while_it_provisions_loses_access(environment, owner, teammate, settings):
    use_backend(settings, "something_happens_while_building")
    # The removal commits while the first apply is in flight; its resync skips
    # environments that are not ready yet.
    SomethingHappensWhileBuilding.during = lambda: services.membership_remove(
        actor=owner, tenant=environment.tenant, username="tom"
    )
    assert environments.environment_provision_run(environment_id=environment.id) == "ready"
    record = json.loads((settings.LOCAL_WORKSPACE_DIR / "acme-train" / "environment.json").read_text())
    assert [member["username"] for member in record["members"]] == ["olivia"]


def test_a_late_teardown_of_an_old_environment_spares_the_new_one_with_its_namespace(environment, tenant, owner, settings):
    environments.environment_provision_run(environment_id=environment.id)
    old_spec = environments.environment_spec(environment)
    Environment.objects.filter(id=environment.id).update(state="deleted")
    get_backend().delete_environment(old_spec)
    newer = Environment.objects.create(tenant=tenant, name="train", namespace="acme-train", backend="local")
    assert environments.environment_provision_run(environment_id=newer.id) == "ready"
    get_backend().delete_environment(old_spec)  # a redelivered teardown of the old one
    record = json.loads((settings.LOCAL_WORKSPACE_DIR / "acme-train" / "environment.json").read_text())
    assert record["environment_id"] == newer.id
