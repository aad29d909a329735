"""The reconcile's lease moved to jobs.ReconcileLease; the cycle's row keeps only its own figures."""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('scheduling', '0001_initial'),
    ]

    operations = [
        migrations.RemoveField(
            model_name='schedulercycle',
            name='reconcile_lease_until',
        ),
    ]
