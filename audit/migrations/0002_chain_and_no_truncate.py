"""The hash chain (prev_hash, hash; existing entries chained in id order) and TRUNCATE refused by the
trigger: nobody but a superuser (who could drop the trigger anyway; the test suite empties every
table between transactional tests as one) empties the log. Run as the role that owns the table."""

from django.db import migrations, models

from audit.chain import HASHED_FIELDS, entry_hash

REFUSE = """
CREATE OR REPLACE FUNCTION audit_entry_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' AND (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION 'audit_auditentry is append-only: % refused', TG_OP;
END;
$$
"""
REFUSE_BEFORE = """
CREATE OR REPLACE FUNCTION audit_entry_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_auditentry is append-only: % refused', TG_OP;
END;
$$
"""


def chain_existing(apps, schema_editor):
    AuditEntry = apps.get_model("audit", "AuditEntry")
    previous = ""
    for entry in AuditEntry.objects.order_by("id").iterator(chunk_size=2000):
        values = {field: getattr(entry, field) for field in HASHED_FIELDS if field != "prev_hash"}
        values["prev_hash"] = previous
        previous = entry_hash(values)
        AuditEntry.objects.filter(id=entry.id).update(prev_hash=values["prev_hash"], hash=previous)


class Migration(migrations.Migration):

    dependencies = [
        ('audit', '0001_initial'),
    ]

    operations = [
        migrations.AddField(
            model_name='auditentry',
            name='prev_hash',
            field=models.CharField(blank=True, editable=False, max_length=64),
        ),
        migrations.AddField(
            model_name='auditentry',
            name='hash',
            field=models.CharField(blank=True, editable=False, max_length=64),
        ),
        migrations.RunSQL(
            "ALTER TABLE audit_auditentry DISABLE TRIGGER audit_entry_append_only",
            "ALTER TABLE audit_auditentry ENABLE TRIGGER audit_entry_append_only",
        ),
        migrations.RunPython(chain_existing, migrations.RunPython.noop, elidable=False),
        migrations.RunSQL(
            "ALTER TABLE audit_auditentry ENABLE TRIGGER audit_entry_append_only",
            "ALTER TABLE audit_auditentry DISABLE TRIGGER audit_entry_append_only",
        ),
        migrations.RunSQL(
            [REFUSE, "CREATE TRIGGER audit_entry_no_truncate BEFORE TRUNCATE ON audit_auditentry "
                     "FOR EACH STATEMENT EXECUTE FUNCTION audit_entry_append_only()"],
            ["DROP TRIGGER IF EXISTS audit_entry_no_truncate ON audit_auditentry", REFUSE_BEFORE],
        ),
    ]
