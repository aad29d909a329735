"""The ledger charges a tenant's stored checkpoints exactly: at every moment, the bytes of the distinct chunks its
durable checkpoints name, each once across its jobs, through saves that share chunks and discards that leave
shared chunks in the store (a fine-tune's frozen base outliving the checkpoint that first stored it).

Checkpoints go through the checkpoint store's own reservation, seal and discard; the ledger is read as the
usage pages read it (what is written plus what the sweep has not reached) and as the sweep writes it.
"""

import hashlib
import os
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import transaction
from django.db.models import Count, Sum
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runners.jobs import checkpoint_store
from runners.jobs.models import Checkpoint, CheckpointHandover, Job
from runners.storage import chunks
from runners.usage import ledger
from runners.usage.models import UsageEntry

pytestmark = pytest.mark.integration

GB = 10**9
START = datetime(2026, 11, 2, 9, tzinfo=UTC)
# Sizes of the chunks the random histories draw from: large enough that a day of one is many GB-seconds
# beside the ledger's rounding (0.001 GB-second per entry).
POOL_SIZES = [300_000, 450_000, 600_000, 750_000, 900_000, 1_050_000, 1_200_000, 1_350_000]


@pytest.fixture(autouse=True)
def _store_in_tmp(settings, tmp_path):
    settings.DATA_STORAGE_URL = f"file://{tmp_path}/store"
    settings.DATA_STORAGE_OPTIONS = {}
    settings.USAGE_STORAGE_PRICE_PER_GB_MONTH = Decimal("0.10")


class _Pool(list):
    """Chunks in the store (the seal checks that a manifest's chunks are there), each with its bytes."""

    def __repr__(self) -> str:  # hypothesis prints the test's arguments: not megabytes of them
        return f"<{len(self)} chunks>"


@pytest.fixture
def pool(_store_in_tmp) -> _Pool:
    store = checkpoint_store.checkpoint_blobs()
    out = _Pool()
    for size in POOL_SIZES:
        data = os.urandom(size)
        sha256, stored = store.put_bytes(data)
        out.append((chunks.ChunkRef(sha256, stored), data))
    return out


def _job(tenant, environment, flavor, name: str, **spec) -> Job:
    return Job.objects.create(tenant=tenant, environment=environment, name=name, flavor=flavor, replicas=1,
                              gpus_per_replica=1, state="running", spec={"template": "pytorch-ddp", **spec})


def _manifest(pieces: list[tuple[chunks.ChunkRef, bytes]]) -> chunks.Manifest:
    whole = hashlib.sha256()
    for _, data in pieces:
        whole.update(data)
    return chunks.Manifest(whole.hexdigest(), sum(ref.bytes for ref, _ in pieces), tuple(ref for ref, _ in pieces))


def _reserved(job: Job, step: int, manifest: chunks.Manifest, at: datetime) -> Checkpoint:
    """A checkpoint claimed by the worker and its chunks reserved against the tenant's quota."""
    checkpoint = Checkpoint.objects.create(job=job, step=step, uri=f"file:///step-{step}.pt", bytes=manifest.bytes,
                                           created_at=at - timedelta(minutes=1), store_state="storing")
    checkpoint = Checkpoint.objects.select_related("job__tenant").get(id=checkpoint.id)
    checkpoint_store.checkpoint_reserve(checkpoint, manifest)
    return checkpoint


def _save(job: Job, step: int, manifest: chunks.Manifest, at: datetime) -> Checkpoint:
    """A checkpoint stored as the worker stores it: claimed, its chunks reserved, then sealed durable at `at`."""
    checkpoint = _reserved(job, step, manifest, at)
    assert checkpoint_store.checkpoint_seal(checkpoint.id, manifest, now=at) == "durable"
    return checkpoint


def _charged_gb_seconds(tenant, now: datetime) -> tuple[Decimal, int]:
    """The tenant's checkpoint storage the ledger charges up to `now` (written plus not written yet), in
    GB-seconds, and how many rounded pieces it is made of."""
    written = (UsageEntry.objects.filter(tenant=tenant, kind="storage")
               .aggregate(gb=Sum("gb_seconds"), count=Count("id")))
    pending = [piece for piece in ledger.unwritten(now, tenant_ids={tenant.id}) if piece.kind == "storage"]
    return (Decimal(written["gb"] or 0) + sum((piece.gb_seconds for piece in pending), Decimal(0)),
            written["count"] + len(pending))


def _assert_charged(tenant, now: datetime, expected_byte_seconds: int) -> None:
    charged, pieces = _charged_gb_seconds(tenant, now)
    expected = Decimal(expected_byte_seconds) / GB
    # Each written entry and each unwritten piece is rounded to 0.001 GB-second.
    assert abs(charged - expected) <= Decimal("0.0006") * (pieces + 1), (
        f"tenant {tenant.slug} is charged {charged} GB-s up to {now}, the store held {expected} GB-s")


def _distinct_bytes(manifests) -> int:
    return chunks.distinct_bytes(manifests)


def test_a_fine_tunes_frozen_base_is_charged_all_along_while_retention_keeps_only_the_newest(
        tenant, acme_env, flavors, tmp_path):
    """10 checkpoints over a frozen base; keep_newest 1 discards each checkpoint as the next is stored, the
    one that first stored the base included: the base's bytes stay charged from the first save to the end."""
    job = _job(tenant, acme_env, flavors["h100-80gb"], "finetune", checkpoint_retention={"keep_newest": 1})
    store = checkpoint_store.checkpoint_blobs()
    base = os.urandom(4 << 20)
    charged_at, byte_seconds, held, steps, manifests = START, 0, 0, [], []
    for index in range(10):
        at = START + timedelta(hours=7 * index, minutes=13)
        byte_seconds += held * int((at - charged_at).total_seconds())
        charged_at = at
        path = tmp_path / f"step-{index}.pt"
        path.write_bytes(base + os.urandom(64 << 10) + index.to_bytes(4, "big"))
        manifest, _ = chunks.store_file(store, path)
        manifests.append(manifest)
        steps.append(_save(job, 10 * (index + 1), manifest, at))
        discarded = checkpoint_store.retention_apply(tenant_id=tenant.id, now=at)
        assert sum(item["checkpoints"] for item in discarded) == (1 if index else 0)
        held = checkpoint_store.tenant_stored_bytes(tenant.id)
        assert held == _distinct_bytes([manifest])  # the newest alone is kept: the store holds it whole
        assert held >= len(base)
        if index % 3 == 2:
            ledger.settle_run(now=at)  # days written as the beat writes them, the rest read as unwritten
        _assert_charged(tenant, at, byte_seconds)

    end = START + timedelta(days=4, hours=2)
    byte_seconds += held * int((end - charged_at).total_seconds())
    _assert_charged(tenant, end, byte_seconds)
    ledger.settle_run(now=end + timedelta(days=1))
    _assert_charged(tenant, end + timedelta(days=1), byte_seconds + held * 86400)
    # The base moved at each discard to the checkpoint that keeps it: nine handovers, each the chunks the two
    # checkpoints share (the base but for its last chunk, cut together with what changed).
    handovers = list(CheckpointHandover.objects.filter(checkpoint__job=job).order_by("handed_at"))
    assert [handover.checkpoint_id for handover in handovers] == [checkpoint.id for checkpoint in steps[1:]]
    for handover, older, newer in zip(handovers, manifests, manifests[1:]):
        shared = {chunk.sha256: chunk.bytes for chunk in older.chunks if chunk in newer.chunks}
        assert handover.bytes == sum(shared.values()) >= len(base) - chunks.MAX_CHUNK_BYTES
    # Without them the ledger charged each checkpoint only what it added, the base ending with the first.
    first_stored = Checkpoint.objects.get(id=steps[0].id)
    assert first_stored.store_state == "discarded" and first_stored.stored_bytes >= len(base)
    assert all(Checkpoint.objects.get(id=checkpoint.id).stored_bytes < len(base) for checkpoint in steps[1:])


class _RolledBack(Exception):
    """Raised at the end of each example so its rows go with its savepoint."""


# One history step: what happens, on which job (two jobs of tenant one, one of tenant two), which chunks a save
# names or which kept checkpoints a discard takes (a bitmask), and the minutes since the previous step.
STEP = st.tuples(st.sampled_from(["save", "save", "save", "discard", "sweep"]), st.integers(0, 2),
                 st.integers(0, 255), st.integers(1, 30 * 60))


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(history=st.lists(STEP, min_size=2, max_size=10))
@pytest.mark.django_db
def test_the_ledger_charges_the_integral_of_the_distinct_bytes_kept_over_random_histories(
        history, tenant, other_tenant, acme_env, globex_env, flavors, pool):
    try:
        with transaction.atomic():
            _replay(history, tenant, other_tenant, acme_env, globex_env, flavors, pool)
            raise _RolledBack
    except _RolledBack:
        pass


def _replay(history, tenant, other_tenant, acme_env, globex_env, flavors, pool) -> None:
    flavor = flavors["h100-80gb"]
    jobs = [_job(tenant, acme_env, flavor, "first"), _job(tenant, acme_env, flavor, "second"),
            _job(other_tenant, globex_env, flavor, "theirs")]
    tenants = (tenant, other_tenant)
    kept: dict[int, dict[int, chunks.Manifest]] = {tenant.id: {}, other_tenant.id: {}}  # durable, per tenant
    byte_seconds = {tenant.id: 0, other_tenant.id: 0}
    now, step = START, 0

    for action, job_index, mask, minutes in history:
        at = now + timedelta(minutes=minutes)
        for owner in tenants:  # what each tenant's store held since the previous step
            byte_seconds[owner.id] += _distinct_bytes(kept[owner.id].values()) * int((at - now).total_seconds())
        now = at
        job = jobs[job_index]
        if action == "save":
            step += 1
            named = [pool[index] for index in range(len(pool)) if mask >> index & 1] or [pool[step % len(pool)]]
            manifest = _manifest(named)
            kept[job.tenant_id][_save(job, step, manifest, at).id] = manifest
        elif action == "discard":
            candidates = sorted(kept[job.tenant_id])
            chosen = [checkpoint_id for bit, checkpoint_id in enumerate(candidates) if mask >> bit & 1]
            assert checkpoint_store.checkpoints_discard(tenant_id=job.tenant_id, checkpoint_ids=chosen,
                                                        now=at) == len(chosen)
            for checkpoint_id in chosen:
                del kept[job.tenant_id][checkpoint_id]
        else:
            ledger.settle_run(now=at)
        # The tenant acted on: the store's bytes are the distinct bytes kept, and the charge their integral.
        assert checkpoint_store.tenant_stored_bytes(job.tenant_id) == _distinct_bytes(kept[job.tenant_id].values())
        _assert_charged(job.tenant, at, byte_seconds[job.tenant_id])

    # Two days on, the sweep having written everything up to the last midnight, what is left read as unwritten.
    end = now + timedelta(days=2)
    ledger.settle_run(now=end)
    for owner in tenants:
        byte_seconds[owner.id] += _distinct_bytes(kept[owner.id].values()) * int((end - now).total_seconds())
        _assert_charged(owner, end, byte_seconds[owner.id])


def test_a_tenant_is_charged_for_a_chunk_another_tenant_also_stores_and_never_for_theirs(
        tenant, other_tenant, acme_env, globex_env, flavors, pool):
    """Deduplication is per tenant: a discard hands over only to the tenant's own kept checkpoints."""
    flavor = flavors["h100-80gb"]
    mine, theirs = _job(tenant, acme_env, flavor, "mine"), _job(other_tenant, globex_env, flavor, "theirs")
    shared = _manifest(pool[:3])
    first = _save(mine, 1, shared, START)
    _save(theirs, 1, shared, START + timedelta(hours=1))
    second = _save(mine, 2, _manifest(pool[1:4]), START + timedelta(hours=2))
    assert Checkpoint.objects.get(id=second.id).stored_bytes == POOL_SIZES[3]
    checkpoint_store.checkpoints_discard(tenant_id=tenant.id, checkpoint_ids=[first.id],
                                         now=START + timedelta(hours=3))
    # Chunks 1 and 2 are handed to my second checkpoint; chunk 0 is charged to nobody of mine any more.
    assert list(CheckpointHandover.objects.values_list("checkpoint_id", "bytes")) == [
        (second.id, POOL_SIZES[1] + POOL_SIZES[2])]
    # Mine: chunks 0-2 for two hours, 0-3 for one, then 1-3 for two; theirs: chunks 0-2 for four hours.
    end = START + timedelta(hours=5)
    _assert_charged(tenant, end, (sum(POOL_SIZES[:3]) * 2 + sum(POOL_SIZES[:4]) + sum(POOL_SIZES[1:4]) * 2) * 3600)
    _assert_charged(other_tenant, end, sum(POOL_SIZES[:3]) * 4 * 3600)


def test_a_checkpoint_sealed_before_one_reserved_earlier_is_charged_the_chunks_they_share(
        tenant, acme_env, flavors, pool):
    """Its reservation left out the chunks the earlier one had reserved; once durable first, it is charged them
    (the earlier one's worker then dies: back to pending, it holds nothing and is charged nothing)."""
    job = _job(tenant, acme_env, flavors["h100-80gb"], "racing")
    first = _reserved(job, 1, _manifest(pool[:3]), START)
    second = _reserved(job, 2, _manifest(pool[:4]), START)
    assert Checkpoint.objects.get(id=second.id).stored_bytes == POOL_SIZES[3]  # its reservation
    assert checkpoint_store.checkpoint_seal(second.id, _manifest(pool[:4]), now=START) == "durable"
    assert checkpoint_store.checkpoints_stuck_release(now=START + timedelta(days=1)) == [first.id]
    assert Checkpoint.objects.get(id=second.id).stored_bytes == sum(POOL_SIZES[:4])
    _assert_charged(tenant, START + timedelta(hours=2), sum(POOL_SIZES[:4]) * 2 * 3600)
