# Environments move to the runners app. Step 1 of 3: the table takes runners' name, rows
# untouched; runners 0002 then adopts the model, tenants 0005 forgets it.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("tenants", "0003_dns_label_message"),
    ]

    operations = [
        migrations.AlterModelTable(name="environment", table="runners_environment"),
    ]
