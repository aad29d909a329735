# Step 3 of 3 of the move to runners: tenants forgets the Environment model (its table is runners' now).

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("tenants", "0004_environment_table_to_runners"),
        ("runners", "0002_environments_and_partitions"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(state_operations=[migrations.DeleteModel(name="Environment")]),
    ]
