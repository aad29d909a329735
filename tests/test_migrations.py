"""Moving environments and partitions to runners keeps every row: migrate a database holding data.

Two moves, checked in one test so that the database goes back through the heads once: from today's heads back
to the last release's (before the split of runners into its apps), forward and back again (the split's checks);
then, emptied of those rows, on back to the heads before the first move (of environments and partitions to
runners) and forward to today's (that move's checks). Each pass of the migration executor renders every model
state it goes through, a few seconds of CPU each: two tests of their own took six passes, this one five, and
its passes back from the split's heads unapply only the first move's migrations, not every later one again.
"""

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

pytestmark = pytest.mark.integration

# The heads before environments, partition profiles and partition changes moved to runners.
BEFORE = [
    ("tenants", "0003_dns_label_message"), ("quotas", "0004_guarantee_reduction"), ("runners", "0001_initial"),
    ("contenttypes", "0002_remove_content_type_name"),
]


def _migrate(targets):
    executor = MigrationExecutor(connection)
    executor.migrate(targets)
    executor.loader.build_graph()
    return executor.loader.project_state([target for target in targets if target[1] is not None]).apps


def _fill_before_the_move(old) -> dict:
    """A database at the heads before the move to runners: an environment, partitions, nodes, flavors, a quota."""
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
    return {"environment": environment.id, "pool": pool.id, "profile": profile.id, "change": change.id,
            "slice_flavor": slice_flavor.id, "whole": whole.id, "content_type": old_content_type.id}


def _check_after_the_move(ids: dict) -> None:
    """Today's models see the rows _fill_before_the_move wrote, and flavors got their capacity."""
    from django.contrib.contenttypes.models import ContentType

    from quotas.models import Quota, ResourceFlavor
    from runners.clusters.models import NodePool, PartitionChange, PartitionProfile
    from runners.environments.models import Environment

    moved = Environment.objects.get(id=ids["environment"])
    assert (moved.tenant.slug, moved.namespace, moved.created_by.username) == ("acme", "acme--train", "olivia")
    assert (moved.sync_generation, moved.synced_generation, moved.state) == (3, 2, "ready")
    assert NodePool.objects.get(id=ids["pool"]).partition_profile == PartitionProfile.objects.get(id=ids["profile"])
    assert PartitionProfile.objects.get(id=ids["profile"]).layout == ["3g.40gb", "2g.20gb", "2g.20gb"]
    assert PartitionChange.objects.get(id=ids["change"]).steps == [{"step": "succeeded"}]
    assert Quota.objects.get(tenant__slug="acme").flavor.name == "h100-2g"
    # Capacity counts schedulable GPUs only: 2 GPUs x 2 slices on node 1; node 2 is cordoned.
    assert ResourceFlavor.objects.get(id=ids["slice_flavor"]).capacity == 4
    assert ResourceFlavor.objects.get(id=ids["whole"]).capacity == 0
    # Its content type came along, to runners then (this move) and on to environments (the next).
    assert ContentType.objects.get(id=ids["content_type"]).app_label == "environments"
    # New rows keep coming after the old ones (the id sequences came along with the tables).
    assert Environment.objects.create(
        tenant=moved.tenant, name="eval", namespace="acme--eval", backend="local"
    ).id > ids["environment"]


# The heads before the models of runners moved to the apps inside it (clusters, environments, jobs,
# scheduling), each keeping its table.
BEFORE_THE_SPLIT = [
    ("tenants", "0005_forget_environment"), ("quotas", "0006_forget_partitions_flavor_capacity"),
    ("runners", "0006_job_leases_metrics_idempotency"), ("contenttypes", "0002_remove_content_type_name"),
    ("clusters", None), ("environments", None), ("jobs", None), ("scheduling", None),
]
MOVED = {
    "clusters": ["nodepool", "node", "gpu", "partitionprofile", "partitionchange"],
    "environments": ["environment"],
    "jobs": ["job", "jobattempt", "checkpoint", "jobmetric", "idempotencykey", "jobevent"],
    "scheduling": ["schedulercycle"],
}


def _fill_before_the_split(old) -> dict:
    """A database as the last release left it: one of everything, linked as the portal links it."""
    user = old.get_model("auth", "User").objects.create(username="olivia")
    tenant = old.get_model("tenants", "Tenant").objects.create(slug="acme", name="Acme")
    flavor = old.get_model("quotas", "ResourceFlavor").objects.create(name="h100-80gb", kind="whole",
                                                                     gpu_model="H100-80GB")
    old.get_model("quotas", "Quota").objects.create(tenant=tenant, flavor=flavor, guaranteed=8, max=16)
    profile = old.get_model("runners", "PartitionProfile").objects.create(
        name="h100-whole", gpu_model="H100-80GB", kind="whole", layout=[]
    )
    pool = old.get_model("runners", "NodePool").objects.create(name="h100-pool", gpu_model="H100-80GB",
                                                               partition_profile=profile)
    node = old.get_model("runners", "Node").objects.create(
        name="h100-node-1", pool=pool, cpu_milli=96000, memory_mib=1024, source="local", seen_at="2026-12-01T00:00:00Z",
        nvlink_domain="nvl-1", rack="r1",
    )
    gpu = old.get_model("runners", "Gpu").objects.create(node=node, index=0, model="H100-80GB", memory_mib=81920)
    change = old.get_model("runners", "PartitionChange").objects.create(
        pool=pool, profile=profile, state="succeeded", steps=[{"step": "succeeded"}], created_by=user
    )
    environment = old.get_model("runners", "Environment").objects.create(
        tenant=tenant, name="train", namespace="acme--train", backend="local", state="ready", created_by=user,
    )
    job = old.get_model("runners", "Job").objects.create(
        tenant=tenant, environment=environment, name="llm", spec={"steps": 100}, flavor=flavor, replicas=1,
        gpus_per_replica=1, state="running", submitted_by=user, progress_cursor={"0": 42}, reconcile_errors=1,
    )
    first = old.get_model("runners", "JobAttempt").objects.create(
        job=job, number=1, placement=[{"node": "h100-node-1", "gpus": [0]}], ended_at="2026-12-01T01:00:00Z",
        outcome="preempted", reason="Preempted for job 9",
    )
    second = old.get_model("runners", "JobAttempt").objects.create(
        job=job, number=2, placement=[{"node": "h100-node-1", "gpus": [0]}], started_at="2026-12-01T01:05:00Z",
        resumed_from_step=50, launch_token="t-2",
    )
    checkpoint = old.get_model("runners", "Checkpoint").objects.create(
        job=job, attempt=first, step=50, uri="file:///ckpt/50", bytes=1234, created_at="2026-12-01T00:59:00Z"
    )
    old.get_model("runners", "JobMetric").objects.create(job=job, attempt=2, step=60, loss=1.5, samples_per_s=80.0)
    old.get_model("runners", "JobEvent").objects.create(job=job, from_state="queued", to_state="admitted",
                                                       reason="Admitted")
    old.get_model("runners", "IdempotencyKey").objects.create(user=user, key="k-1", request_hash="0" * 64, job=job)
    old.get_model("runners", "SchedulerCycle").objects.create(id=1, runs=7, reconcile_lease_until=None)
    ContentType = old.get_model("contenttypes", "ContentType")
    content_types = {model: ContentType.objects.get_or_create(app_label="runners", model=model)[0].id
                     for models in MOVED.values() for model in models}
    return {"user": user.id, "pool": pool.id, "node": node.id, "gpu": gpu.id, "change": change.id,
            "environment": environment.id, "job": job.id, "first": first.id, "second": second.id,
            "checkpoint": checkpoint.id, "content_types": content_types}


def _empty_the_tables() -> None:
    """Every row gone but the migrations applied, the content types and the permissions: the database as a test
    of its own would find it (flushed, the content types and permissions there), at the heads it is at now."""
    keep = {"django_migrations", "django_content_type", "auth_permission"}
    with connection.cursor() as cursor:
        cursor.execute("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
        tables = sorted(name for (name,) in cursor.fetchall() if name not in keep)
        cursor.execute("TRUNCATE " + ", ".join(connection.ops.quote_name(name) for name in tables))


@pytest.mark.django_db(transaction=True)
def test_every_row_survives_the_split_of_runners_into_its_apps_and_the_way_back_and_the_move_to_runners():
    """From the last release's heads to today's: the same rows under the new models, the links between
    them intact, the content types relabelled (so permissions follow), new ids after the old ones;
    and back again, where the old models see the same rows.

    Then the move before (environments and partitions to runners): emptied, the database goes on back to the heads
    before it, gets rows there, and forward to today's heads, where the rows survive and flavors get their
    capacity."""
    ids = _fill_before_the_split(_migrate(BEFORE_THE_SPLIT))

    executor = MigrationExecutor(connection)
    _migrate(executor.loader.graph.leaf_nodes())

    from django.contrib.contenttypes.models import ContentType

    from runners.clusters.models import Gpu, Node, NodePool, PartitionChange
    from runners.environments.models import Environment
    from runners.jobs.models import Checkpoint, IdempotencyKey, Job, JobAttempt, JobEvent, JobMetric
    from runners.scheduling.models import SchedulerCycle

    job = Job.objects.get(id=ids["job"])
    assert (job.environment.namespace, job.tenant.slug, job.flavor.name, job.submitted_by.username) == (
        "acme--train", "acme", "h100-80gb", "olivia")
    assert (job.state, job.progress_cursor, job.reconcile_errors) == ("running", {"0": 42}, 1)
    assert [(a.number, a.outcome, a.resumed_from_step) for a in job.attempts.order_by("number")] == [
        (1, "preempted", None), (2, "", 50)]
    assert JobAttempt.objects.get(id=ids["second"]).launch_token == "t-2"
    assert Checkpoint.objects.get(id=ids["checkpoint"]).attempt_id == ids["first"]
    assert list(JobMetric.objects.filter(job=job).values_list("step", "loss")) == [(60, 1.5)]
    assert JobEvent.objects.get(job=job).to_state == "admitted"
    assert IdempotencyKey.objects.get(key="k-1").job_id == job.id
    assert Gpu.objects.get(id=ids["gpu"]).node.pool == NodePool.objects.get(id=ids["pool"])
    assert Node.objects.get(id=ids["node"]).nvlink_domain == "nvl-1"
    assert PartitionChange.objects.get(id=ids["change"]).steps == [{"step": "succeeded"}]
    assert Environment.objects.get(id=ids["environment"]).jobs.get() == job
    assert SchedulerCycle.objects.get(id=1).runs == 7
    for label, models in MOVED.items():
        for model in models:
            assert ContentType.objects.get(id=ids["content_types"][model]).app_label == label, model
    # The tables are the same ones: their sequences go on after the old rows.
    later = Job.objects.create(tenant=job.tenant, environment=job.environment, name="next", spec={},
                               flavor=job.flavor, replicas=1, gpus_per_replica=1)
    assert later.id > job.id
    assert JobAttempt.objects.create(job=later, number=1).id > ids["second"]

    back = _migrate(BEFORE_THE_SPLIT)
    assert back.get_model("runners", "Job").objects.get(id=ids["job"]).attempts.count() == 2
    assert back.get_model("runners", "Environment").objects.get(id=ids["environment"]).namespace == "acme--train"
    assert ContentType.objects.get(id=ids["content_types"]["job"]).app_label == "runners"

    _empty_the_tables()
    moved = _fill_before_the_move(_migrate(BEFORE))
    _migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())
    _check_after_the_move(moved)
