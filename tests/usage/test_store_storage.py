"""The ledger charges the store's real bytes: a checkpoint's bytes after deduplication while the checkpoint
store holds it, and each tenant's dataset shards once, to the tenant that owns them."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db.models import Sum

from runners.datasets.models import Dataset, DatasetShare, DatasetVersion, VersionShard
from runners.jobs.models import Checkpoint, Job
from runners.usage import ledger
from runners.usage.models import UsageEntry
from tenants.models import Tenant

pytestmark = pytest.mark.integration

PRICE = Decimal("0.10")  # per GB-month
GB = 10**9
START = datetime(2026, 11, 2, tzinfo=UTC)
NOW = START + timedelta(days=5, hours=6)
MONTH_S = 30 * 86400


@pytest.fixture(autouse=True)
def _price(settings):
    settings.USAGE_STORAGE_PRICE_PER_GB_MONTH = PRICE


def _expected(*charges: tuple[int, datetime, datetime]) -> Decimal:
    """bytes x seconds x price, summed over (bytes, from, until)."""
    total = sum(Decimal(size) / GB * Decimal((until - since).total_seconds()) for size, since, until in charges)
    return total * PRICE / MONTH_S


def _charged(tenant, now: datetime) -> Decimal:
    """What the ledger charges the tenant for storage up to `now`: what it wrote and what it would add."""
    written = UsageEntry.objects.filter(tenant=tenant, kind="storage").aggregate(cost=Sum("cost"))["cost"] or 0
    pending = sum((piece.cost for piece in ledger.unwritten(now, tenant_ids={tenant.id}) if piece.kind == "storage"),
                  Decimal(0))
    return Decimal(written) + pending


def _close(a: Decimal, b: Decimal) -> bool:
    return abs(a - b) < Decimal("0.00005")


@pytest.fixture
def job(tenant, acme_env, flavors):
    return Job.objects.create(tenant=tenant, environment=acme_env, name="finetune", spec={"template": "pytorch-ddp"},
                              flavor=flavors["h100-80gb"], replicas=1, gpus_per_replica=1, state="running")


def _checkpoint(job, step, **fields) -> Checkpoint:
    return Checkpoint.objects.create(job=job, step=step, uri=f"file:///step-{step}.pt", bytes=50 * GB,
                                     created_at=START + timedelta(hours=step), **fields)


def test_a_stored_checkpoint_is_charged_its_bytes_after_dedup_from_durable_until_discarded(tenant, job):
    # The first holds the frozen base (3 GB after dedup); the second adds only its changed tensors (1 GB).
    # Each file is 50 GB: none of that is charged while the store holds the checkpoint.
    base_durable, base_discarded = START + timedelta(hours=1, minutes=3), START + timedelta(days=2, hours=7)
    base = _checkpoint(job, 1, store_state="durable", stored_bytes=3 * GB, durable_at=base_durable)
    delta_durable = START + timedelta(days=1, hours=2, minutes=1)
    _checkpoint(job, 26, store_state="durable", stored_bytes=1 * GB, durable_at=delta_durable)

    before = _expected((3 * GB, base_durable, NOW), (1 * GB, delta_durable, NOW))
    assert _close(_charged(tenant, NOW), before)
    ledger.settle_run(now=NOW)
    assert _close(_charged(tenant, NOW), before)  # the same whether written or not

    # Retention discards the base; the ledger learns it after having written days past it.
    Checkpoint.objects.filter(id=base.id).update(store_state="discarded", discarded_at=base_discarded, manifest=None)
    later = NOW + timedelta(days=2)
    ledger.settle_run(now=later)
    assert _close(_charged(tenant, later), _expected((3 * GB, base_durable, base_discarded),
                                                     (1 * GB, delta_durable, later)))
    assert UsageEntry.objects.filter(item=f"checkpoint:{base.id}", correction=True, cost__lt=0).exists()


def test_a_checkpoint_is_charged_nothing_while_stored_and_its_file_when_the_store_refused_it(tenant, job):
    pending = _checkpoint(job, 2, store_state="pending")
    refused = _checkpoint(job, 3, store_state="failed", store_reason="over quota", deleted_at=START + timedelta(days=1))
    never = _checkpoint(job, 4, store_state="")  # a backend whose files the portal cannot read: on the volume
    # Superseded while the agent was behind, never stored: its file stays on the volume until pruned.
    skipped = _checkpoint(job, 5, store_state="skipped", deleted_at=START + timedelta(hours=12))
    ledger.settle_run(now=NOW)
    assert not UsageEntry.objects.filter(item=f"checkpoint:{pending.id}").exists()
    file_charges = [(50 * GB, refused.created_at, refused.deleted_at), (50 * GB, never.created_at, NOW),
                    (50 * GB, skipped.created_at, skipped.deleted_at)]
    assert _close(_charged(tenant, NOW), _expected(*file_charges))

    # Stored a day later than written: charged its bytes after dedup from then, found by the next sweep.
    durable_at = START + timedelta(days=1, hours=5)
    Checkpoint.objects.filter(id=pending.id).update(store_state="durable", stored_bytes=2 * GB, durable_at=durable_at)
    later = NOW + timedelta(days=1)
    ledger.settle_run(now=later)
    assert _close(_charged(tenant, later), _expected((50 * GB, refused.created_at, refused.deleted_at),
                                                     (50 * GB, never.created_at, later), (2 * GB, durable_at, later),
                                                     (50 * GB, skipped.created_at, skipped.deleted_at)))


def _version(tenant, name, number, sealed_at, shards: list[tuple[str, int]], state="sealed") -> DatasetVersion:
    dataset, _ = Dataset.objects.get_or_create(tenant=tenant, name=name)
    version = DatasetVersion.objects.create(dataset=dataset, number=number, state=state,
                                            sealed_at=sealed_at if state == "sealed" else None)
    VersionShard.objects.bulk_create([VersionShard(version=version, position=position, sha256=sha * 64, bytes=size,
                                                   stored=True) for position, (sha, size) in enumerate(shards)])
    return version


def test_each_tenant_pays_once_for_the_dataset_shards_it_owns_and_nothing_for_those_shared_with_it(
        tenant, other_tenant):
    reader = Tenant.objects.create(slug="reader", name="Reader")
    first, second = START + timedelta(hours=3), START + timedelta(days=2)
    one = _version(tenant, "images", 1, first, [("a", 4 * GB), ("b", 2 * GB)])
    # Version 2 keeps shard a, adds c; another dataset of the same tenant holds b again: b and a are paid once.
    _version(tenant, "images", 2, second, [("a", 4 * GB), ("c", 1 * GB)])
    _version(tenant, "crops", 1, second, [("b", 2 * GB)])
    _version(tenant, "images", 3, None, [("d", 9 * GB)], state="open")  # being pushed: not charged yet
    # The other tenant stored shard a on its own: it pays for its copy, whatever the first tenant holds.
    theirs = _version(other_tenant, "mirror", 1, second, [("a", 4 * GB)])
    DatasetShare.objects.create(dataset=one.dataset, tenant=reader)

    assert ledger.dataset_stored_bytes([one.id]) == {one.id: 6 * GB}
    ledger.settle_run(now=NOW)
    mine = _expected((6 * GB, first, NOW), (1 * GB, second, NOW))
    assert _close(_charged(tenant, NOW), mine)
    assert _close(_charged(other_tenant, NOW), _expected((4 * GB, second, NOW)))
    assert _charged(reader, NOW) == 0
    assert set(UsageEntry.objects.filter(item=f"dataset:{theirs.id}").values_list("tenant_id", flat=True)) == {
        other_tenant.id}
    assert ledger.settle_run(now=NOW)["entries"] == 0  # settled: a second sweep the same day writes nothing
