"""The scheduling models, moved out of runners with their tables as they were (state only)."""

from django.db import migrations, models

from common.model_moves import content_types_moved, state_only


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('runners', '0006_job_leases_metrics_idempotency'),
        ('contenttypes', '0002_remove_content_type_name'),
    ]

    operations = [
        state_only(
            migrations.CreateModel(
                name='SchedulerCycle',
                fields=[
                    ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                    ('runs', models.PositiveBigIntegerField(default=0)),
                    ('last_started_at', models.DateTimeField(blank=True, null=True)),
                    ('last_duration_ms', models.FloatField(default=0)),
                    ('last_admitted', models.PositiveIntegerField(default=0)),
                    ('last_preempted', models.PositiveIntegerField(default=0)),
                    ('last_waiting', models.PositiveIntegerField(default=0)),
                    ('reconcile_lease_until', models.DateTimeField(blank=True, null=True)),
                ],
                options={
                    'db_table': 'runners_schedulercycle',
                },
            ),
        ),
        content_types_moved("runners", "scheduling", ['SchedulerCycle']),
    ]
