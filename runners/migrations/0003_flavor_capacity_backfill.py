# Fill in each flavor's capacity from the inventory already synced, so guarantee checks hold
# from the first request after the upgrade rather than after the next inventory sync. The
# same counting as runners.services.flavor_capacity_refresh, on this migration's models.

from collections import Counter

from django.db import migrations
from django.utils import timezone


def backfill(apps, schema_editor):
    Gpu = apps.get_model("runners", "Gpu")
    ResourceFlavor = apps.get_model("quotas", "ResourceFlavor")
    units = Counter()
    for gpu in Gpu.objects.filter(node__schedulable=True):
        if gpu.partition_kind == "mig":
            units.update(("mig", gpu.model, profile) for profile, _start in gpu.mig_layout)
        elif gpu.partition_kind == "timeslice":
            units[("timeslice", gpu.model, "")] += gpu.timeslice_replicas
        else:
            units[("whole", gpu.model, "")] += 1
    now = timezone.now()
    for flavor in ResourceFlavor.objects.all():
        flavor.capacity = units.get((flavor.kind, flavor.gpu_model, flavor.mig_profile), 0)
        flavor.capacity_updated_at = now
        flavor.save(update_fields=["capacity", "capacity_updated_at"])


class Migration(migrations.Migration):

    dependencies = [
        ("runners", "0002_environments_and_partitions"),
        ("quotas", "0006_forget_partitions_flavor_capacity"),
    ]

    operations = [
        migrations.RunPython(backfill, migrations.RunPython.noop),
    ]
