"""Webhooks added and deleted, and a member's mail choices changed, each write one audit entry with the
actor, in the change's own transaction (never the webhook's secret)."""

import pytest

from audit.models import AuditEntry
from runners.notifications.models import Webhook

pytestmark = pytest.mark.integration

HOOK = "https://hooks.example.test/portal"


def _new(mark: int) -> list[tuple]:
    return list(AuditEntry.objects.filter(id__gt=mark).order_by("id").values_list(
        "action", "actor_name", "tenant_slug", "object_type", "before", "after"))


def _mark() -> int:
    return AuditEntry.objects.order_by("-id").values_list("id", flat=True).first() or 0


@pytest.mark.django_db
def test_adding_and_deleting_a_webhook_are_audited(client_for, owner, tenant):
    api = client_for(owner)
    mark = _mark()
    created = api.post(f"/api/v1/tenants/{tenant.slug}/webhooks/", {"url": HOOK, "events": ["job_failed"]},
                       format="json")
    assert created.status_code == 201, created.json()
    webhook = Webhook.objects.get()
    after = {"url": HOOK, "events": ["job_failed"], "active": True}
    assert _new(mark) == [("webhook.created", "olivia", "acme", "webhook", None, after)]
    assert webhook.secret not in str(AuditEntry.objects.filter(id__gt=mark).values())

    mark = _mark()
    assert api.delete(f"/api/v1/tenants/{tenant.slug}/webhooks/{webhook.id}/").status_code == 204
    assert _new(mark) == [("webhook.deleted", "olivia", "acme", "webhook", after, None)]


@pytest.mark.django_db
def test_a_refused_webhook_writes_no_entry(client_for, owner, teammate, tenant):
    as_member, as_owner = client_for(teammate), client_for(owner)
    mark = _mark()
    assert as_member.post(f"/api/v1/tenants/{tenant.slug}/webhooks/",
                          {"url": HOOK, "events": ["job_failed"]}, format="json").status_code == 403
    assert as_owner.post(f"/api/v1/tenants/{tenant.slug}/webhooks/",
                         {"url": "http://127.0.0.1/h", "events": ["job_failed"]}, format="json").status_code == 400
    assert _new(mark) == []


@pytest.mark.django_db
def test_changing_mail_choices_is_audited_with_what_changed(client_for, teammate, tenant):
    api = client_for(teammate)
    mark = _mark()
    answer = api.patch(f"/api/v1/notification-preferences/{tenant.slug}/",
                       {"email": {"job_finished": True, "job_failed": True}}, format="json")
    assert answer.status_code == 200, answer.json()
    # job_failed was already on (the default): only job_finished changed.
    assert _new(mark) == [("preferences.changed", "tom", "acme", "preference",
                           {"job_finished": False}, {"job_finished": True})]
    entry = AuditEntry.objects.get(id__gt=mark)
    assert entry.object_repr == "tom in acme"

    mark = _mark()
    assert api.patch(f"/api/v1/notification-preferences/{tenant.slug}/", {"email": {"job_finished": True}},
                     format="json").status_code == 200
    assert _new(mark) == [], "nothing changed: no entry"
