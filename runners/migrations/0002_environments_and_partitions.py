# Environments, partition profiles and partition changes now belong to runners. Step 2 of 3:
# runners adopts the models over the tables tenants 0004 and quotas 0005 renamed (state only,
# nothing is copied), the node pools' foreign key points at runners' profile, and the content
# types follow so admin permissions keep working.

import django.core.validators
import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

MOVED = [("tenants", "environment"), ("quotas", "partitionprofile"), ("quotas", "partitionchange")]


def move_content_types(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    for app_label, model in MOVED:
        if not ContentType.objects.filter(app_label="runners", model=model).exists():
            ContentType.objects.filter(app_label=app_label, model=model).update(app_label="runners")


def restore_content_types(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    for app_label, model in MOVED:
        ContentType.objects.filter(app_label="runners", model=model).update(app_label=app_label)


class Migration(migrations.Migration):

    dependencies = [
        ("contenttypes", "0002_remove_content_type_name"),
        ("runners", "0001_initial"),
        ("quotas", "0005_partition_tables_to_runners"),
        ("tenants", "0004_environment_table_to_runners"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='PartitionProfile',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('name', models.CharField(max_length=63, unique=True)),
                        ('gpu_model', models.CharField(max_length=40)),
                        ('kind', models.CharField(choices=[('whole', 'Whole'), ('mig', 'Mig'), ('timeslice', 'Timeslice')], max_length=10)),
                        ('layout', models.JSONField(blank=True, default=list)),
                        ('replicas', models.PositiveSmallIntegerField(default=1)),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                    ],
                    options={
                        'ordering': ['gpu_model', 'name'],
                    },
                ),
                migrations.AlterField(
                    model_name='nodepool',
                    name='partition_profile',
                    field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='node_pools', to='runners.partitionprofile'),
                ),
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
                        ('created_by', models.ForeignKey(null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='environments_created', to=settings.AUTH_USER_MODEL)),
                        ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='environments', to='tenants.tenant')),
                    ],
                    options={
                        'ordering': ['tenant__slug', 'name'],
                        'indexes': [models.Index(fields=['state', 'state_changed_at'], name='environment_state_age')],
                        'constraints': [models.UniqueConstraint(condition=models.Q(('state', 'deleted'), _negated=True), fields=('tenant', 'name'), name='unique_live_environment_name'), models.UniqueConstraint(condition=models.Q(('state', 'deleted'), _negated=True), fields=('namespace',), name='unique_live_environment_namespace')],
                    },
                ),
                migrations.CreateModel(
                    name='PartitionChange',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('drain', models.CharField(choices=[('wait', 'Wait'), ('preempt', 'Preempt')], default='wait', max_length=10)),
                        ('state', models.CharField(choices=[('pending', 'Pending'), ('cordoning', 'Cordoning'), ('draining', 'Draining'), ('relabeling', 'Relabeling'), ('waiting', 'Waiting'), ('uncordoning', 'Uncordoning'), ('succeeded', 'Succeeded'), ('refused', 'Refused'), ('failed', 'Failed')], default='pending', max_length=20)),
                        ('message', models.CharField(blank=True, max_length=1000)),
                        ('steps', models.JSONField(blank=True, default=list)),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('finished_at', models.DateTimeField(blank=True, null=True)),
                        ('lease_expires_at', models.DateTimeField(blank=True, null=True)),
                        ('kept_cordoned', models.JSONField(blank=True, default=list)),
                        ('created_by', models.ForeignKey(null=True, on_delete=django.db.models.deletion.SET_NULL, to=settings.AUTH_USER_MODEL)),
                        ('pool', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='partition_changes', to='runners.nodepool')),
                        ('profile', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='changes', to='runners.partitionprofile')),
                    ],
                    options={
                        'ordering': ['-created_at', '-id'],
                        'constraints': [models.UniqueConstraint(condition=models.Q(('state__in', ['succeeded', 'refused', 'failed']), _negated=True), fields=('pool',), name='one_partition_change_in_flight_per_pool')],
                    },
                ),
            ],
        ),
        migrations.RunPython(move_content_types, restore_content_types),
    ]
