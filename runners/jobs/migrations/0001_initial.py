"""The jobs models, moved out of runners with their tables as they were (state only)."""

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
        ('environments', '0001_initial'),
        ('quotas', '0006_forget_partitions_flavor_capacity'),
        ('tenants', '0005_forget_environment'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        state_only(
            migrations.CreateModel(
                name='Job',
                fields=[
                    ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                    ('name', models.CharField(max_length=63, validators=[django.core.validators.RegexValidator('^[a-z0-9]+(-[a-z0-9]+)*$', "Must be a DNS-1123 label without '--': lowercase letters and digits, with single '-' between them.")])),
                    ('kind', models.CharField(choices=[('training', 'Training')], default='training', max_length=20)),
                    ('spec', models.JSONField()),
                    ('replicas', models.PositiveSmallIntegerField()),
                    ('gpus_per_replica', models.PositiveSmallIntegerField()),
                    ('priority', models.PositiveSmallIntegerField(default=0)),
                    ('preemptible', models.BooleanField(default=True)),
                    ('state', models.CharField(choices=[('queued', 'Queued'), ('admitted', 'Admitted'), ('launching', 'Launching'), ('running', 'Running'), ('preempted', 'Preempted'), ('cancelling', 'Cancelling'), ('succeeded', 'Succeeded'), ('failed', 'Failed'), ('cancelled', 'Cancelled')], default='queued', max_length=20)),
                    ('reason', models.CharField(blank=True, max_length=1000)),
                    ('queue_position', models.PositiveIntegerField(blank=True, null=True)),
                    ('failures', models.PositiveSmallIntegerField(default=0)),
                    ('stop_deadline', models.DateTimeField(blank=True, null=True)),
                    ('submitted_at', models.DateTimeField(auto_now_add=True)),
                    ('state_changed_at', models.DateTimeField(auto_now_add=True)),
                    ('started_at', models.DateTimeField(blank=True, null=True)),
                    ('finished_at', models.DateTimeField(blank=True, null=True)),
                    ('reconcile_errors', models.PositiveIntegerField(default=0)),
                    ('reconcile_after', models.DateTimeField(blank=True, null=True)),
                    ('reconcile_error', models.CharField(blank=True, max_length=1000)),
                    ('progress_cursor', models.JSONField(blank=True, default=dict)),
                    ('environment', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='jobs', to='environments.environment')),
                    ('flavor', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='jobs', to='quotas.resourceflavor')),
                    ('submitted_by', models.ForeignKey(null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL)),
                    ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='jobs', to='tenants.tenant')),
                ],
                options={
                    'db_table': 'runners_job',
                    'ordering': ['-submitted_at', '-id'],
                },
            ),
            migrations.CreateModel(
                name='IdempotencyKey',
                fields=[
                    ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                    ('key', models.CharField(max_length=255)),
                    ('request_hash', models.CharField(max_length=64)),
                    ('created_at', models.DateTimeField(auto_now_add=True)),
                    ('user', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to=settings.AUTH_USER_MODEL)),
                    ('job', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='jobs.job')),
                ],
                options={
                    'db_table': 'runners_idempotencykey',
                },
            ),
            migrations.CreateModel(
                name='JobAttempt',
                fields=[
                    ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                    ('number', models.PositiveSmallIntegerField()),
                    ('placement', models.JSONField(default=list)),
                    ('admitted_at', models.DateTimeField(auto_now_add=True)),
                    ('started_at', models.DateTimeField(blank=True, null=True)),
                    ('ended_at', models.DateTimeField(blank=True, null=True)),
                    ('outcome', models.CharField(blank=True, choices=[('succeeded', 'Succeeded'), ('failed', 'Failed'), ('preempted', 'Preempted'), ('node_lost', 'Node Lost'), ('cancelled', 'Cancelled')], max_length=20)),
                    ('exit_code', models.IntegerField(blank=True, null=True)),
                    ('reason', models.CharField(blank=True, max_length=1000)),
                    ('resumed_from_step', models.PositiveIntegerField(blank=True, null=True)),
                    ('launch_token', models.CharField(blank=True, max_length=36)),
                    ('launch_lease_until', models.DateTimeField(blank=True, null=True)),
                    ('first_step_at', models.DateTimeField(blank=True, null=True)),
                    ('job', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='attempts', to='jobs.job')),
                ],
                options={
                    'db_table': 'runners_jobattempt',
                    'ordering': ['job_id', 'number'],
                },
            ),
            migrations.CreateModel(
                name='Checkpoint',
                fields=[
                    ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                    ('step', models.PositiveIntegerField()),
                    ('uri', models.CharField(max_length=1000)),
                    ('bytes', models.PositiveBigIntegerField(default=0)),
                    ('created_at', models.DateTimeField()),
                    ('job', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='checkpoints', to='jobs.job')),
                    ('attempt', models.ForeignKey(null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='checkpoints', to='jobs.jobattempt')),
                ],
                options={
                    'db_table': 'runners_checkpoint',
                    'ordering': ['job_id', 'step'],
                },
            ),
            migrations.CreateModel(
                name='JobEvent',
                fields=[
                    ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                    ('at', models.DateTimeField(auto_now_add=True)),
                    ('from_state', models.CharField(blank=True, max_length=20)),
                    ('to_state', models.CharField(max_length=20)),
                    ('reason', models.CharField(blank=True, max_length=1000)),
                    ('job', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='events', to='jobs.job')),
                ],
                options={
                    'db_table': 'runners_jobevent',
                    'ordering': ['job_id', 'at', 'id'],
                },
            ),
            migrations.CreateModel(
                name='JobMetric',
                fields=[
                    ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                    ('attempt', models.PositiveSmallIntegerField()),
                    ('step', models.PositiveIntegerField()),
                    ('loss', models.FloatField(null=True)),
                    ('samples_per_s', models.FloatField(null=True)),
                    ('at', models.CharField(blank=True, max_length=40)),
                    ('job', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='metrics', to='jobs.job')),
                ],
                options={
                    'db_table': 'runners_jobmetric',
                    'ordering': ['job_id', 'step', 'attempt'],
                },
            ),
            migrations.AddIndex(
                model_name='job',
                index=models.Index(fields=['state', 'priority'], name='job_state_priority'),
            ),
            migrations.AddIndex(
                model_name='job',
                index=models.Index(fields=['tenant', 'state'], name='job_tenant_state'),
            ),
            migrations.AddIndex(
                model_name='idempotencykey',
                index=models.Index(fields=['created_at'], name='idempotency_key_age'),
            ),
            migrations.AddConstraint(
                model_name='idempotencykey',
                constraint=models.UniqueConstraint(fields=('user', 'key'), name='unique_idempotency_key_per_user'),
            ),
            migrations.AddConstraint(
                model_name='jobattempt',
                constraint=models.UniqueConstraint(fields=('job', 'number'), name='unique_attempt_number'),
            ),
            migrations.AddConstraint(
                model_name='checkpoint',
                constraint=models.UniqueConstraint(fields=('job', 'step'), name='unique_checkpoint_step'),
            ),
            migrations.AddConstraint(
                model_name='jobmetric',
                constraint=models.UniqueConstraint(fields=('job', 'step', 'attempt'), name='unique_metric_step_attempt'),
            ),
        ),
        content_types_moved("runners", "jobs", ['Job', 'IdempotencyKey', 'JobAttempt', 'Checkpoint', 'JobEvent', 'JobMetric']),
    ]
