"""The chain's head: one row with the last entry's hash, locked by each append."""

from django.db import migrations, models


def head_at_the_last_entry(apps, schema_editor):
    AuditEntry = apps.get_model("audit", "AuditEntry")
    AuditChainHead = apps.get_model("audit", "AuditChainHead")
    last = AuditEntry.objects.order_by("-id").values_list("hash", flat=True).first()
    AuditChainHead.objects.create(id=1, hash=last or "")


class Migration(migrations.Migration):

    dependencies = [
        ('audit', '0002_chain_and_no_truncate'),
    ]

    operations = [
        migrations.CreateModel(
            name='AuditChainHead',
            fields=[
                ('id', models.PositiveSmallIntegerField(default=1, primary_key=True, serialize=False)),
                ('hash', models.CharField(blank=True, max_length=64)),
            ],
        ),
        migrations.RunPython(head_at_the_last_entry, migrations.RunPython.noop, elidable=False),
    ]
