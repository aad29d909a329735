"""The notifications API: a tenant's webhooks and their log for its owners; each member's own mail choices."""

import pytest

from runners.notifications import services
from runners.notifications.models import Delivery, Event, Preference, Webhook

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

HOOK = "https://hooks.example.test/portal"


def _webhooks(slug: str) -> str:
    return f"/api/v1/tenants/{slug}/webhooks/"


def test_an_owner_adds_a_webhook_sees_its_secret_once_and_deletes_it(client_for, owner, tenant):
    api = client_for(owner)
    created = api.post(_webhooks("acme"), {"url": HOOK, "events": ["job_failed", "job_preempted"]}, format="json")
    assert created.status_code == 201, created.json()
    body = created.json()
    assert body["url"] == HOOK and body["events"] == ["job_failed", "job_preempted"] and body["active"] is True
    assert body["created_by"] == "olivia" and len(body["secret"]) == 64

    listed = api.get(_webhooks("acme")).json()
    assert [item["id"] for item in listed["results"]] == [body["id"]]
    assert "secret" not in listed["results"][0]
    assert "secret" not in api.get(f"{_webhooks('acme')}{body['id']}/").json()

    assert api.delete(f"{_webhooks('acme')}{body['id']}/").status_code == 204
    assert api.get(_webhooks("acme")).json()["results"] == []


@pytest.mark.parametrize("data, field", [
    ({"url": "ftp://example.test/h", "events": ["job_failed"]}, "url"),
    ({"url": "not a url", "events": ["job_failed"]}, "url"),
    ({"url": 5, "events": ["job_failed"]}, "url"),
    ({"events": ["job_failed"]}, "url"),
    ({"url": HOOK, "events": []}, "events"),
    ({"url": HOOK, "events": ["job_exploded"]}, "events"),
    ({"url": HOOK, "events": "job_failed"}, "events"),
    ({"url": HOOK, "events": ["job_failed"], "secret": "mine"}, "secret"),
])
def test_a_bad_webhook_is_a_400_naming_the_field(client_for, owner, tenant, data, field):
    response = client_for(owner).post(_webhooks("acme"), data, format="json")
    assert response.status_code == 400 and field in response.json(), response.json()


def test_members_who_are_not_owners_get_403_and_other_tenants_404(client_for, owner, teammate, outsider, tenant):
    webhook = services.webhook_create(actor=owner, tenant=tenant, url=HOOK, events=["job_failed"])
    member = client_for(teammate)
    assert member.get(_webhooks("acme")).status_code == 403
    assert member.post(_webhooks("acme"), {"url": HOOK, "events": ["job_failed"]}, format="json").status_code == 403
    assert member.delete(f"{_webhooks('acme')}{webhook.id}/").status_code == 403

    stranger = client_for(outsider)
    for path in (_webhooks("acme"), f"{_webhooks('acme')}{webhook.id}/", f"{_webhooks('acme')}{webhook.id}/deliveries/"):
        assert stranger.get(path).status_code == 404, path
    assert stranger.delete(f"{_webhooks('acme')}{webhook.id}/").status_code == 404
    # Through the stranger's own tenant: the id of acme's webhook is no webhook of globex.
    assert stranger.get(f"{_webhooks('globex')}{webhook.id}/deliveries/").status_code == 404
    assert stranger.delete(f"{_webhooks('globex')}{webhook.id}/").status_code == 404
    assert stranger.get(_webhooks("globex")).json()["results"] == []
    assert Webhook.objects.filter(id=webhook.id).exists(), "no refused delete went through"


def test_the_delivery_log_lists_each_try_newest_first(client_for, owner, tenant):
    webhook = services.webhook_create(actor=owner, tenant=tenant, url=HOOK, events=["quota_changed"])
    for number in (1, 2):
        event = Event.objects.create(tenant=tenant, kind="quota_changed", key=f"quota:{number}",
                                     payload={"event": "quota_changed", "n": number}, occurred_at="2026-12-04T10:00Z")
        Delivery.objects.create(webhook=webhook, event=event, kind="quota_changed", payload=event.payload,
                                attempts=number, status_code=500, error="Answered 500.", state="pending")
    log = client_for(owner).get(f"{_webhooks('acme')}{webhook.id}/deliveries/")
    assert log.status_code == 200
    rows = log.json()["results"]
    assert [row["payload"]["n"] for row in rows] == [2, 1]
    assert rows[0] | {"id": 0, "created_at": "", "next_try_at": None} == {
        "id": 0, "event": "quota_changed", "state": "pending", "attempts": 2, "status_code": 500,
        "error": "Answered 500.", "next_try_at": None, "delivered_at": None, "created_at": "",
        "payload": {"event": "quota_changed", "n": 2},
    }


def test_a_member_reads_and_changes_only_their_own_mail_choices(client_for, owner, teammate, outsider, tenant):
    api = client_for(teammate)
    defaults = {"job_finished": False, "job_failed": True, "job_preempted": True, "environment_failed": True,
                "quota_changed": False, "workspace_stopped": True}
    assert api.get("/api/v1/notification-preferences/").json() == [{"tenant": "acme", "email": defaults}]

    patched = api.patch("/api/v1/notification-preferences/acme/", {"email": {"job_finished": True}}, format="json")
    assert patched.status_code == 200 and patched.json()["email"] == defaults | {"job_finished": True}
    everything_off = dict.fromkeys(defaults, False)
    put = api.put("/api/v1/notification-preferences/acme/", {"email": everything_off}, format="json")
    assert put.status_code == 200 and put.json()["email"] == everything_off
    assert api.get("/api/v1/notification-preferences/acme/").json()["email"] == everything_off
    # Olivia's choices are her own.
    assert client_for(owner).get("/api/v1/notification-preferences/acme/").json()["email"] == defaults
    assert set(Preference.objects.values_list("user__username", flat=True)) == {"tom"}

    assert client_for(outsider).get("/api/v1/notification-preferences/acme/").status_code == 404
    assert client_for(outsider).patch("/api/v1/notification-preferences/acme/", {"email": {"job_failed": False}},
                                      format="json").status_code == 404


@pytest.mark.parametrize("method, data, field", [
    ("put", {"email": {"job_failed": True}}, "email"),  # PUT names every event
    ("patch", {"email": {"job_exploded": True}}, "email.job_exploded"),
    ("patch", {"email": {"job_failed": "yes"}}, "email"),
    ("patch", {"email": ["job_failed"]}, "email"),
    ("patch", {"mail": {"job_failed": True}}, "mail"),
])
def test_a_bad_choice_is_a_400_naming_the_field(client_for, teammate, method, data, field):
    response = getattr(client_for(teammate), method)("/api/v1/notification-preferences/acme/", data, format="json")
    assert response.status_code == 400 and field in response.json(), response.json()


def test_the_schema_documents_the_notification_endpoints(client, staff):
    client.force_login(staff)
    paths = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()["paths"]
    webhooks = "/api/v1/tenants/{tenant_slug}/webhooks/"
    assert {"get", "post"} <= set(paths[webhooks])
    assert {"get", "delete"} <= set(paths[webhooks + "{id}/"])
    assert "get" in paths[webhooks + "{id}/deliveries/"]
    assert {"get", "put", "patch"} <= set(paths["/api/v1/notification-preferences/{tenant}/"])
    created = paths[webhooks]["post"]["responses"]["201"]["content"]["application/json"]["schema"]["$ref"]
    assert created.endswith("/WebhookCreated")
