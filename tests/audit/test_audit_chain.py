"""The audit log cannot be emptied or forged unseen: TRUNCATE is refused by a trigger, the portal's role
(which does not own the table) can neither disable the trigger nor change or delete an entry, and every
entry carries the hash of the one before it, so `manage.py audit_verify` finds a gap or a forgery.

The roles are real PostgreSQL roles made inside the test's transaction (rolled back with it)."""

import io
import threading

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, close_old_connections, connection, connections, transaction

from audit.models import AuditEntry
from audit.services import SYSTEM, record

pytestmark = pytest.mark.integration

APP_ROLE = "portal_app_test"


def _verify() -> str:
    """audit_verify's output; CommandError (with its report) when the chain is broken."""
    out = io.StringIO()
    call_command("audit_verify", stdout=out)
    return out.getvalue()


def _as(role: str, sql: str, params=None) -> None:
    """Run one statement as the role, in a savepoint (an error rolls back to it, and the role with it)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"SET LOCAL ROLE {role}")
        cursor.execute(sql, params)
        cursor.execute("RESET ROLE")


def _entries(n: int) -> list[AuditEntry]:
    return [record("flavor.created", actor=SYSTEM, object_type="resourceflavor", object_id=i, after={"n": i, "x": 1.5})
            for i in range(n)]


@pytest.fixture
def app_role(db):
    """A role like the portal's in production: granted what the app needs, owning nothing."""
    from audit.roles import grant_app_role

    with connection.cursor() as cursor:
        cursor.execute(f"CREATE ROLE {APP_ROLE} NOLOGIN")
        grant_app_role(cursor, APP_ROLE)
    return APP_ROLE


@pytest.mark.django_db
def test_truncate_is_refused_by_the_trigger_even_to_a_role_granted_it():
    _entries(2)
    with connection.cursor() as cursor:
        cursor.execute("CREATE ROLE audit_truncater NOLOGIN")
        cursor.execute("GRANT SELECT, TRUNCATE ON audit_auditentry TO audit_truncater")
    with pytest.raises(DatabaseError, match="append-only: TRUNCATE refused"):
        _as("audit_truncater", "TRUNCATE audit_auditentry")
    assert AuditEntry.objects.count() == 2


@pytest.mark.django_db
def test_the_apps_role_can_neither_empty_change_delete_nor_unhook_the_log(app_role):
    entries = _entries(3)
    refused = [
        "TRUNCATE audit_auditentry",
        "ALTER TABLE audit_auditentry DISABLE TRIGGER audit_entry_append_only",
        "ALTER TABLE audit_auditentry DISABLE TRIGGER ALL",
        "DROP TRIGGER audit_entry_append_only ON audit_auditentry",
        f"DELETE FROM audit_auditentry WHERE id = {entries[1].id}",
        f"UPDATE audit_auditentry SET action = 'nothing.happened' WHERE id = {entries[1].id}",
    ]
    for sql in refused:
        with pytest.raises(DatabaseError):
            _as(app_role, sql)
    assert list(AuditEntry.objects.order_by("id").values_list("id", "action")) == [
        (e.id, "flavor.created") for e in entries]
    # What the app does need, it has: it writes (a change of its own) and reads.
    _as(app_role, "SELECT count(*) FROM audit_auditentry")
    assert "3 entries" in _verify()


@pytest.mark.django_db
def test_a_forged_insert_by_the_apps_role_is_found_by_audit_verify(app_role):
    entries = _entries(2)
    _as(app_role, "INSERT INTO audit_auditentry (at, actor_name, tenant_slug, action, object_type, object_id, "
                  "object_repr, request_id, prev_hash, hash) VALUES "
                  "(now(), 'olivia', 'acme', 'quota.updated', 'quota', '1', '', '', %s, %s)",
        [entries[-1].hash, "0" * 64])
    record("job.cancelled", actor=SYSTEM, object_type="job", object_id=1)  # a genuine entry after it
    with pytest.raises(CommandError) as broken:
        _verify()
    assert "does not match its contents" in str(broken.value)


@pytest.mark.django_db
def test_a_deleted_entry_is_a_gap_audit_verify_finds(app_role):
    """Deleted by a superuser who turned the trigger off: the next entry's link to it is broken."""
    entries = _entries(4)
    assert "4 entries" in _verify()
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE audit_auditentry DISABLE TRIGGER audit_entry_append_only")
        cursor.execute("DELETE FROM audit_auditentry WHERE id = %s", [entries[1].id])
        cursor.execute("ALTER TABLE audit_auditentry ENABLE TRIGGER audit_entry_append_only")
    with pytest.raises(CommandError) as broken:
        _verify()
    assert f"entry {entries[2].id}" in str(broken.value) and "gap" in str(broken.value)


@pytest.mark.django_db
def test_entries_removed_from_the_end_are_found_by_audit_verify():
    """No entry follows the last, so no link breaks: the chain's head still names it."""
    entries = _entries(3)
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE audit_auditentry DISABLE TRIGGER audit_entry_append_only")
        cursor.execute("DELETE FROM audit_auditentry WHERE id = %s", [entries[-1].id])
        cursor.execute("ALTER TABLE audit_auditentry ENABLE TRIGGER audit_entry_append_only")
    with pytest.raises(CommandError) as broken:
        _verify()
    assert f"the log ends at entry {entries[1].id}" in str(broken.value) and "removed from its end" in str(broken.value)


@pytest.mark.django_db
def test_a_changed_entry_is_found_by_audit_verify():
    entries = _entries(3)
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE audit_auditentry DISABLE TRIGGER audit_entry_append_only")
        cursor.execute("UPDATE audit_auditentry SET after = '{\"n\": 99, \"x\": 1.5}' WHERE id = %s", [entries[1].id])
        cursor.execute("ALTER TABLE audit_auditentry ENABLE TRIGGER audit_entry_append_only")
    with pytest.raises(CommandError) as broken:
        _verify()
    assert f"entry {entries[1].id} does not match its contents" in str(broken.value)


@pytest.mark.django_db(transaction=True)
def test_two_transactions_appending_at_once_make_one_chain():
    """The first appends and holds its transaction open; the second appends meanwhile. The second waits for
    the first to commit (the append is serialized), so both chain one after the other, not to one entry."""
    _entries(1)
    first_recorded, commit_first = threading.Event(), threading.Event()
    errors = []

    def first():
        try:
            with transaction.atomic():
                record("quota.updated", actor=SYSTEM, object_type="quota", object_id=1)
                first_recorded.set()
                commit_first.wait(30)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    def second():
        try:
            with transaction.atomic():
                record("quota.updated", actor=SYSTEM, object_type="quota", object_id=2)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert first_recorded.wait(30)
    threads.append(threading.Thread(target=second))
    threads[1].start()

    def second_waits_on_a_lock() -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted AND pid <> pg_backend_pid()")
            return cursor.fetchone()[0] > 0

    # Either the second is waiting for the first (serialized), or it already committed (not serialized).
    for _ in range(300):
        if second_waits_on_a_lock() or not threads[1].is_alive():
            break
        threads[1].join(0.1)
    commit_first.set()
    for thread in threads:
        thread.join(30)
    close_old_connections()
    assert not errors, errors
    assert "3 entries" in _verify()


@pytest.mark.django_db
def test_migrate_grants_the_portals_role_what_it_needs_and_no_more(settings):
    """What the migrate Job does (as the owner) for DATABASE_APP_ROLE."""
    from runners.jobs.models import Job

    with connection.cursor() as cursor:
        cursor.execute("CREATE ROLE portal_app_migrated NOLOGIN")
    settings.DATABASE_APP_ROLE = "portal_app_migrated"
    call_command("migrate", verbosity=0)

    def can(table: str, privilege: str) -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT has_table_privilege('portal_app_migrated', %s, %s)", [table, privilege])
            return cursor.fetchone()[0]

    job = Job._meta.db_table
    assert all(can(job, p) for p in ("SELECT", "INSERT", "UPDATE", "DELETE")) and not can(job, "TRUNCATE")
    assert can("audit_auditentry", "SELECT") and can("audit_auditentry", "INSERT")
    assert not any(can("audit_auditentry", p) for p in ("UPDATE", "DELETE", "TRUNCATE", "TRIGGER", "REFERENCES"))
