"""Who reads the audit log (staff everything; a tenant's owners and admins their tenant's; nobody
else anything), and that nothing edits or deletes an entry: not the API, the admin, the ORM nor SQL."""

from datetime import timedelta
from datetime import timezone as dt_timezone
from urllib.parse import urlencode

import pytest
from django.db import DatabaseError, connection, transaction

from audit.models import AppendOnlyError, AuditEntry
from audit.services import SCHEDULER, record
from tenants.models import Membership, Tenant

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def entries(tenant, other_tenant, owner, outsider, staff):
    """One entry of each tenant and one of none."""
    return {
        "acme": record("quota.updated", actor=staff, tenant=tenant, object_type="quota", object_id=1,
                       before={"max": 4}, after={"max": 6}),
        "globex": record("job.preempted", actor=SCHEDULER, tenant=other_tenant, object_type="job", object_id=2,
                         after={"state": "preempted"}),
        "none": record("flavor.created", actor=staff, object_type="resourceflavor", object_id=3, after={"name": "x"}),
    }


def _ids(client, query="") -> set[int]:
    answer = client.get(f"/api/v1/audit/{query}")
    assert answer.status_code == 200, answer.content
    return {row["id"] for row in answer.json()["results"]}


def test_staff_read_every_entry(entries, staff, client_for):
    client = client_for(staff)
    assert {e.id for e in entries.values()} <= _ids(client)
    body = client.get(f"/api/v1/audit/{entries['globex'].id}/").json()
    assert body["actor"] == "scheduler" and body["tenant"] == "globex" and body["action"] == "job.preempted"
    assert body["before"] is None and body["after"] == {"state": "preempted"}


def test_a_tenant_admin_reads_only_their_tenant(entries, tenant, make_user, client_for):
    admin = make_user("ada")
    Membership.objects.create(user=admin, tenant=tenant, role="admin")
    client = client_for(admin)
    assert _ids(client) == {entries["acme"].id}
    assert client.get(f"/api/v1/audit/{entries['acme'].id}/").status_code == 200
    assert client.get(f"/api/v1/audit/{entries['globex'].id}/").status_code == 404
    assert client.get(f"/api/v1/audit/{entries['none'].id}/").status_code == 404
    # Asking for the other tenant by name filters to nothing rather than reaching it.
    assert _ids(client, "?tenant=globex") == set()


def test_an_owner_of_another_tenant_cannot_read_this_one(entries, outsider, client_for):
    client = client_for(outsider)
    assert _ids(client) == {entries["globex"].id}
    assert client.get(f"/api/v1/audit/{entries['acme'].id}/").status_code == 404


@pytest.mark.parametrize("role", ["member", "viewer"])
def test_members_and_viewers_read_nothing(entries, tenant, make_user, client_for, role):
    user = make_user(f"user-{role}")
    Membership.objects.create(user=user, tenant=tenant, role=role)
    client = client_for(user)
    assert _ids(client) == set()
    assert client.get(f"/api/v1/audit/{entries['acme'].id}/").status_code == 404


def test_anonymous_is_refused(entries, client):
    assert client.get("/api/v1/audit/").status_code == 401


def test_filters(entries, staff, client_for):
    client = client_for(staff)
    assert _ids(client, "?tenant=acme") == {entries["acme"].id}
    assert _ids(client, "?action=job.preempted") == {entries["globex"].id}
    assert _ids(client, "?action=job.") == {entries["globex"].id}
    assert _ids(client, "?actor=scheduler") == {entries["globex"].id}
    assert _ids(client, "?object_type=resourceflavor") == {entries["none"].id}
    at = entries["globex"].at
    assert entries["globex"].id in _ids(client, f"?since={at.isoformat().replace('+00:00', 'Z')}")
    assert entries["globex"].id not in _ids(client, f"?until={at.isoformat().replace('+00:00', 'Z')}")
    assert client.get("/api/v1/audit/?since=").status_code == 400
    assert client.get("/api/v1/audit/?since=yesterday").status_code == 400
    # ISO 8601 allows offsets up to 23:59 (PostgreSQL takes 15:59): compared in UTC, the same moment.
    far_east = (at + timedelta(hours=21, minutes=59)).replace(tzinfo=dt_timezone(timedelta(hours=21, minutes=59)))
    assert entries["globex"].id in _ids(client, "?" + urlencode({"since": far_east.isoformat()}))
    # A moment that is before year 1 in UTC is refused, naming the parameter.
    answer = client.get("/api/v1/audit/?" + urlencode({"since": "0001-01-01T00:00:00+23:59"}))
    assert answer.status_code == 400 and "since" in answer.json()
    # Newest first.
    rows = client.get("/api/v1/audit/").json()["results"]
    assert [row["id"] for row in rows] == sorted((row["id"] for row in rows), reverse=True)


# --- Append-only -------------------------------------------------------------------


def test_the_api_has_no_way_to_write(entries, staff, client_for):
    client = client_for(staff)
    entry = entries["acme"]
    assert client.post("/api/v1/audit/", {"action": "x"}).status_code == 405
    for method in (client.put, client.patch, client.delete):
        assert method(f"/api/v1/audit/{entry.id}/", {"action": "x"}).status_code == 405
    entry.refresh_from_db()
    assert entry.action == "quota.updated"


def test_the_admin_reads_but_cannot_add_change_or_delete(entries, make_user, client):
    admin = make_user("root", is_staff=True, is_superuser=True)
    client.force_login(admin)
    entry = entries["acme"]
    assert client.get("/admin/audit/auditentry/").status_code == 200
    assert client.get(f"/admin/audit/auditentry/{entry.id}/change/").status_code == 200  # a read-only view
    assert client.post(f"/admin/audit/auditentry/{entry.id}/change/", {"action": "x"}).status_code == 403
    assert client.get("/admin/audit/auditentry/add/").status_code == 403
    assert client.post(f"/admin/audit/auditentry/{entry.id}/delete/", {"post": "yes"}).status_code == 403
    assert AuditEntry.objects.filter(id=entry.id, action="quota.updated").exists()


def test_the_model_refuses_to_change_or_delete(entries):
    entry = entries["acme"]
    entry.action = "quota.forged"
    with pytest.raises(AppendOnlyError):
        entry.save()
    with pytest.raises(AppendOnlyError):
        entry.delete()
    with pytest.raises(AppendOnlyError):
        AuditEntry.objects.filter(id=entry.id).update(action="quota.forged")
    with pytest.raises(AppendOnlyError):
        AuditEntry.objects.filter(id=entry.id).delete()
    with pytest.raises(AppendOnlyError):
        AuditEntry.objects.bulk_update([entry], ["action"])
    assert AuditEntry.objects.get(id=entry.id).action == "quota.updated"


@pytest.mark.parametrize("sql", [
    "UPDATE audit_auditentry SET action = 'quota.forged' WHERE id = %s",
    "DELETE FROM audit_auditentry WHERE id = %s",
])
def test_the_database_refuses_raw_sql_too(entries, sql):
    entry = entries["acme"]
    with pytest.raises(DatabaseError, match="append-only"):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql, [entry.id])
    assert AuditEntry.objects.get(id=entry.id).action == "quota.updated"


def test_entries_outlive_their_tenant_and_actor(entries, tenant, staff, client_for, make_user):
    """Deleting a tenant or a user touches none of their entries (a cascade or SET_NULL would be refused)."""
    tenant_id, staff_id = tenant.id, staff.id
    Tenant.objects.filter(id=tenant_id).delete()
    staff.delete()
    entry = AuditEntry.objects.get(id=entries["acme"].id)
    assert (entry.tenant_slug, entry.actor_name, entry.tenant_id, entry.actor_id) == ("acme", "sam", tenant_id, staff_id)
    # And the log still reads, by the names written down.
    reader = make_user("auditor", is_staff=True)
    row = client_for(reader).get(f"/api/v1/audit/{entry.id}/").json()
    assert (row["tenant"], row["actor"]) == ("acme", "sam")


def test_a_change_that_fails_leaves_no_entry(tenant, staff):
    with pytest.raises(RuntimeError), transaction.atomic():
        record("tenant.created", actor=staff, tenant=tenant, obj=tenant)
        raise RuntimeError("the change failed after its entry was written")
    assert not AuditEntry.objects.filter(action="tenant.created", tenant_slug="acme").exists()


def test_the_request_id_is_kept(tenant, staff, client_for):
    import structlog

    structlog.contextvars.bind_contextvars(request_id="req-123")
    try:
        entry = record("tenant.created", actor=staff, tenant=tenant, obj=tenant)
    finally:
        structlog.contextvars.unbind_contextvars("request_id")
    assert entry.request_id == "req-123"
