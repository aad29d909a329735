"""Moving environments and partitions to runners keeps every row: migrate a database holding data."""

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

# The heads before environments, partition profiles and partition changes moved to runners.
BEFORE = [
    ("tenants", "0003_dns_label_message"), ("quotas", "0004_guarantee_reduction"), ("runners", "0001_initial"),
    ("contenttypes", "0002_remove_content_type_name"),
]


def _migrate(targets):
    executor = MigrationExecutor(connection)
    executor.migrate(targets)
    executor.loader.build_graph()
    return executor.loader.project_state(targets).apps


@pytest.mark.django_db(transaction=True)
def test_rows_survive_the_move_to_runners_and_flavors_get_their_capacity():
    old = _migrate(BEFORE)
    user = old.get_model("auth", "User").objects.create(username="olivia")
    tenant = old.get_model("tenants", "Tenant").objects.create(slug="acme", name="Acme")
    environment = old.get_model("tenants", "Environment").objects.create(
        tenant=tenant, name="train", namespace="acme--train", backend="local", state="ready", created_by=user,
        sync_generation=3, synced_generation=2,
    )
    profile = old.get_model("quotas", "PartitionProfile").objects.create(
        name="h100-3g-2x2g", gpu_model="H100-80GB", kind="mig", layout=["3g.40gb", "2g.20gb", "2g.20gb"]
    )
    pool = old.get_model("runners", "NodePool").objects.create(name="h100-pool", gpu_model="H100-80GB", partition_profile=profile)
    node = old.get_model("runners", "Node").objects.create(
        name="h100-node-1", pool=pool, cpu_milli=96000, memory_mib=1024, source="local", seen_at="2026-12-01T00:00:00Z"
    )
    Gpu = old.get_model("runners", "Gpu")
    for index in range(2):
        Gpu.objects.create(node=node, index=index, model="H100-80GB", memory_mib=81920, partition_kind="mig",
                           mig_layout=[["3g.40gb", 4], ["2g.20gb", 0], ["2g.20gb", 2]])
    cordoned = old.get_model("runners", "Node").objects.create(
        name="h100-node-2", pool=pool, cpu_milli=96000, memory_mib=1024, source="local", seen_at="2026-12-01T00:00:00Z",
        schedulable=False,
    )
    Gpu.objects.create(node=cordoned, index=0, model="H100-80GB", memory_mib=81920, partition_kind="mig",
                       mig_layout=[["2g.20gb", 0]])
    change = old.get_model("quotas", "PartitionChange").objects.create(
        pool=pool, profile=profile, state="succeeded", steps=[{"step": "succeeded"}], created_by=user
    )
    Flavor = old.get_model("quotas", "ResourceFlavor")
    slice_flavor = Flavor.objects.create(name="h100-2g", kind="mig", gpu_model="H100-80GB", mig_profile="2g.20gb")
    whole = Flavor.objects.create(name="h100-80gb", kind="whole", gpu_model="H100-80GB")
    old.get_model("quotas", "Quota").objects.create(tenant=tenant, flavor=slice_flavor, guaranteed=2, max=4)
    old_content_type = old.get_model("contenttypes", "ContentType").objects.get_or_create(
        app_label="tenants", model="environment"
    )[0]

    executor = MigrationExecutor(connection)
    _migrate(executor.loader.graph.leaf_nodes())

    from django.contrib.contenttypes.models import ContentType

    from quotas.models import Quota, ResourceFlavor
    from runners.models import Environment, NodePool, PartitionChange, PartitionProfile

    moved = Environment.objects.get(id=environment.id)
    assert (moved.tenant.slug, moved.namespace, moved.created_by.username) == ("acme", "acme--train", "olivia")
    assert (moved.sync_generation, moved.synced_generation, moved.state) == (3, 2, "ready")
    assert NodePool.objects.get(id=pool.id).partition_profile == PartitionProfile.objects.get(id=profile.id)
    assert PartitionProfile.objects.get(id=profile.id).layout == ["3g.40gb", "2g.20gb", "2g.20gb"]
    assert PartitionChange.objects.get(id=change.id).steps == [{"step": "succeeded"}]
    assert Quota.objects.get(tenant__slug="acme").flavor.name == "h100-2g"
    # Capacity counts schedulable GPUs only: 2 GPUs x 2 slices on node 1; node 2 is cordoned.
    assert ResourceFlavor.objects.get(id=slice_flavor.id).capacity == 4
    assert ResourceFlavor.objects.get(id=whole.id).capacity == 0
    assert ContentType.objects.get(id=old_content_type.id).app_label == "runners"
    # New rows keep coming after the old ones (the id sequences came along with the tables).
    assert Environment.objects.create(
        tenant=moved.tenant, name="eval", namespace="acme--eval", backend="local"
    ).id > environment.id
