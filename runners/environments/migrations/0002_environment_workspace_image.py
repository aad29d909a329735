from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("environments", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="environment",
            name="workspace_image",
            field=models.CharField(blank=True, max_length=255),
        ),
    ]
