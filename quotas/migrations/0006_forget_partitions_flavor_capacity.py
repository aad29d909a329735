# Step 3 of 3 of the move to runners: quotas forgets the partition models (their tables are
# runners' now). Flavors get the capacity runners writes on them; runners 0003 fills it in.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("quotas", "0005_partition_tables_to_runners"),
        ("runners", "0002_environments_and_partitions"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(name="PartitionChange"),
                migrations.DeleteModel(name="PartitionProfile"),
            ],
        ),
        migrations.AddField(
            model_name="resourceflavor",
            name="capacity",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="resourceflavor",
            name="capacity_updated_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
