"""The role the portal runs as, when migrations run as the role that owns the tables (MIGRATE_DATABASE_URL):
what it is granted. It reads and writes every table but may only read and add to the audit log; owning
none, it cannot turn the log's trigger off, drop it or empty the table."""

from django.db.backends.utils import CursorWrapper


def grant_app_role(cursor: CursorWrapper, role: str) -> None:
    """Grant the role what the portal needs on every table and sequence of the schema, less the audit log's
    UPDATE, DELETE, TRUNCATE and TRIGGER. Run as the owner, after the migrations."""
    quote = cursor.db.ops.quote_name
    cursor.execute("SELECT current_schema()")
    schema, role = quote(cursor.fetchone()[0]), quote(role)
    cursor.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
    cursor.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role}")
    cursor.execute(f"GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA {schema} TO {role}")
    cursor.execute(f"REVOKE UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER ON audit_auditentry FROM {role}")
