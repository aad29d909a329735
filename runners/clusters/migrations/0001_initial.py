"""The clusters models, moved out of runners with their tables as they were (state only)."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

from common.model_moves import content_types_moved, state_only


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('runners', '0006_job_leases_metrics_idempotency'),
        ('contenttypes', '0002_remove_content_type_name'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        state_only(
            migrations.CreateModel(
                name='NodePool',
                fields=[
                    ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                    ('name', models.CharField(max_length=63, unique=True)),
                    ('gpu_model', models.CharField(blank=True, max_length=40)),
                    ('updated_at', models.DateTimeField(auto_now=True)),
                ],
                options={
                    'db_table': 'runners_nodepool',
                    'ordering': ['name'],
                },
            ),
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
                    'db_table': 'runners_partitionprofile',
                    'ordering': ['gpu_model', 'name'],
                },
            ),
            migrations.CreateModel(
                name='Node',
                fields=[
                    ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                    ('name', models.CharField(max_length=253, unique=True)),
                    ('cpu_milli', models.PositiveBigIntegerField()),
                    ('memory_mib', models.PositiveBigIntegerField()),
                    ('rack', models.CharField(blank=True, max_length=63)),
                    ('block', models.CharField(blank=True, max_length=63)),
                    ('nvlink_domain', models.CharField(blank=True, max_length=253)),
                    ('labels', models.JSONField(blank=True, default=dict)),
                    ('gpu_resources', models.JSONField(blank=True, default=dict)),
                    ('schedulable', models.BooleanField(default=True)),
                    ('source', models.CharField(help_text='The backend that reported this node.', max_length=20)),
                    ('seen_at', models.DateTimeField()),
                    ('pool', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='nodes', to='clusters.nodepool')),
                ],
                options={
                    'db_table': 'runners_node',
                    'ordering': ['name'],
                },
            ),
            migrations.AddField(
                model_name='nodepool',
                name='partition_profile',
                field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='node_pools', to='clusters.partitionprofile'),
            ),
            migrations.CreateModel(
                name='Gpu',
                fields=[
                    ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                    ('index', models.PositiveSmallIntegerField()),
                    ('model', models.CharField(max_length=40)),
                    ('memory_mib', models.PositiveIntegerField()),
                    ('uuid', models.CharField(blank=True, max_length=100)),
                    ('partition_kind', models.CharField(choices=[('whole', 'Whole'), ('mig', 'Mig'), ('timeslice', 'Timeslice')], default='whole', max_length=10)),
                    ('mig_layout', models.JSONField(blank=True, default=list)),
                    ('timeslice_replicas', models.PositiveSmallIntegerField(default=1)),
                    ('node', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='gpus', to='clusters.node')),
                ],
                options={
                    'db_table': 'runners_gpu',
                    'ordering': ['node__name', 'index'],
                    'constraints': [models.UniqueConstraint(fields=('node', 'index'), name='one_gpu_per_node_index')],
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
                    ('pool', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='partition_changes', to='clusters.nodepool')),
                    ('profile', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='changes', to='clusters.partitionprofile')),
                ],
                options={
                    'db_table': 'runners_partitionchange',
                    'ordering': ['-created_at', '-id'],
                    'constraints': [models.UniqueConstraint(condition=models.Q(('state__in', ['succeeded', 'refused', 'failed']), _negated=True), fields=('pool',), name='one_partition_change_in_flight_per_pool')],
                },
            ),
        ),
        content_types_moved("runners", "clusters", ['NodePool', 'PartitionProfile', 'Node', 'Gpu', 'PartitionChange']),
    ]
