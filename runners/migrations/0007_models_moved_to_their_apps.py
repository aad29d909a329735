"""The models moved to runners.clusters, .environments, .jobs and .scheduling: gone from this
app's migration state; their tables stay as they are, now the new apps'."""

from django.db import migrations

from common.model_moves import state_only


class Migration(migrations.Migration):

    dependencies = [
        ('clusters', '0001_initial'),
        ('environments', '0001_initial'),
        ('jobs', '0001_initial'),
        ('scheduling', '0001_initial'),
        ('runners', '0006_job_leases_metrics_idempotency'),
    ]

    operations = [
        state_only(
            migrations.RemoveField(
                model_name='checkpoint',
                name='attempt',
            ),
            migrations.RemoveField(
                model_name='checkpoint',
                name='job',
            ),
            migrations.RemoveField(
                model_name='environment',
                name='created_by',
            ),
            migrations.RemoveField(
                model_name='environment',
                name='tenant',
            ),
            migrations.RemoveField(
                model_name='job',
                name='environment',
            ),
            migrations.RemoveField(
                model_name='gpu',
                name='node',
            ),
            migrations.RemoveField(
                model_name='idempotencykey',
                name='job',
            ),
            migrations.RemoveField(
                model_name='idempotencykey',
                name='user',
            ),
            migrations.RemoveField(
                model_name='job',
                name='flavor',
            ),
            migrations.RemoveField(
                model_name='job',
                name='submitted_by',
            ),
            migrations.RemoveField(
                model_name='job',
                name='tenant',
            ),
            migrations.RemoveField(
                model_name='jobmetric',
                name='job',
            ),
            migrations.RemoveField(
                model_name='jobevent',
                name='job',
            ),
            migrations.RemoveField(
                model_name='jobattempt',
                name='job',
            ),
            migrations.RemoveField(
                model_name='node',
                name='pool',
            ),
            migrations.RemoveField(
                model_name='nodepool',
                name='partition_profile',
            ),
            migrations.RemoveField(
                model_name='partitionchange',
                name='pool',
            ),
            migrations.RemoveField(
                model_name='partitionchange',
                name='created_by',
            ),
            migrations.RemoveField(
                model_name='partitionchange',
                name='profile',
            ),
            migrations.DeleteModel(
                name='SchedulerCycle',
            ),
            migrations.DeleteModel(
                name='Checkpoint',
            ),
            migrations.DeleteModel(
                name='Environment',
            ),
            migrations.DeleteModel(
                name='Gpu',
            ),
            migrations.DeleteModel(
                name='IdempotencyKey',
            ),
            migrations.DeleteModel(
                name='JobMetric',
            ),
            migrations.DeleteModel(
                name='JobEvent',
            ),
            migrations.DeleteModel(
                name='Job',
            ),
            migrations.DeleteModel(
                name='JobAttempt',
            ),
            migrations.DeleteModel(
                name='Node',
            ),
            migrations.DeleteModel(
                name='NodePool',
            ),
            migrations.DeleteModel(
                name='PartitionChange',
            ),
            migrations.DeleteModel(
                name='PartitionProfile',
            ),
        ),
    ]
