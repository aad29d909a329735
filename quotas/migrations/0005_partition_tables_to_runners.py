# Partition profiles and changes move to the runners app. Step 1 of 3: their tables take
# runners' names, rows untouched; runners 0002 then adopts the models, quotas 0006 forgets them.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("quotas", "0004_guarantee_reduction"),
    ]

    operations = [
        migrations.AlterModelTable(name="partitionprofile", table="runners_partitionprofile"),
        migrations.AlterModelTable(name="partitionchange", table="runners_partitionchange"),
    ]
