"""The environments models, moved out of runners with their tables as they were (state only)."""

import django.core.validators
import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

from common.model_moves import content_types_moved, state_only


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('runners', '0006_job_leases_metrics_idempotency'),
        ('contenttypes', '0002_remove_content_type_name'),
        ('tenants', '0005_forget_environment'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        state_only(
            migrations.CreateModel(
                name='Environment',
                fields=[
                    ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                    ('name', models.CharField(max_length=32, validators=[django.core.validators.RegexValidator('^[a-z0-9]+(-[a-z0-9]+)*$', "Must be a DNS-1123 label without '--': lowercase letters and digits, with single '-' between them.")])),
                    ('namespace', models.CharField(max_length=63)),
                    ('backend', models.CharField(max_length=20)),
                    ('state', models.CharField(choices=[('requested', 'Requested'), ('provisioning', 'Provisioning'), ('ready', 'Ready'), ('deleting', 'Deleting'), ('deleted', 'Deleted'), ('failed', 'Failed')], default='requested', max_length=20)),
                    ('status_message', models.CharField(blank=True, max_length=500)),
                    ('created_at', models.DateTimeField(auto_now_add=True)),
                    ('state_changed_at', models.DateTimeField(auto_now_add=True)),
                    ('task_runs', models.PositiveIntegerField(default=0)),
                    ('sync_generation', models.PositiveBigIntegerField(default=0)),
                    ('synced_generation', models.PositiveBigIntegerField(default=0)),
                    ('sync_pending', models.BooleanField(default=False)),
                    ('sync_requested_at', models.DateTimeField(blank=True, null=True)),
                    ('sync_lease_until', models.DateTimeField(blank=True, null=True)),
                    ('delete_requested_at', models.DateTimeField(blank=True, null=True)),
                    ('created_by', models.ForeignKey(null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='environments_created', to=settings.AUTH_USER_MODEL)),
                    ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='environments', to='tenants.tenant')),
                ],
                options={
                    'db_table': 'runners_environment',
                    'ordering': ['tenant__slug', 'name'],
                    'indexes': [models.Index(fields=['state', 'state_changed_at'], name='environment_state_age')],
                    'constraints': [models.UniqueConstraint(condition=models.Q(('state', 'deleted'), _negated=True), fields=('tenant', 'name'), name='unique_live_environment_name'), models.UniqueConstraint(condition=models.Q(('state', 'deleted'), _negated=True), fields=('namespace',), name='unique_live_environment_namespace')],
                },
            ),
        ),
        content_types_moved("runners", "environments", ['Environment']),
    ]
