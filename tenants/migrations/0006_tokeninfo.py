import django.db.models.deletion
from django.db import migrations, models


def name_existing_tokens(apps, schema_editor):
    AuthToken = apps.get_model("knox", "AuthToken")
    TokenInfo = apps.get_model("tenants", "TokenInfo")
    TokenInfo.objects.bulk_create(
        [TokenInfo(token=token, name="made before tokens had names") for token in AuthToken.objects.all()]
    )


class Migration(migrations.Migration):
    dependencies = [
        ("knox", "0009_extend_authtoken_field"),
        ("tenants", "0005_forget_environment"),
    ]

    operations = [
        migrations.CreateModel(
            name="TokenInfo",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("name", models.CharField(max_length=100)),
                ("last_used_at", models.DateTimeField(blank=True, null=True)),
                (
                    "token",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE, related_name="info", to="knox.authtoken"
                    ),
                ),
            ],
            options={"ordering": ["-token__created"]},
        ),
        migrations.RunPython(name_existing_tokens, migrations.RunPython.noop),
    ]
