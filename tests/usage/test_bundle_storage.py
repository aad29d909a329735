"""Code bundles count as storage in the ledger (GB-months, item bundle:<id>), like kept checkpoints."""

from datetime import UTC, date, datetime, timedelta

import pytest

from runners.bundles.models import Bundle
from runners.usage import ledger
from runners.usage.models import UsageEntry
from runners.usage.selectors import usage_rows

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

NOW = datetime(2026, 11, 20, 10, 30, tzinfo=UTC)


def _bundle(tenant, *, size: int, created_at: datetime, sha: str = "a" * 64) -> Bundle:
    bundle = Bundle.objects.create(tenant=tenant, sha256=sha, size_bytes=size, unpacked_bytes=size, files=1)
    Bundle.objects.filter(pk=bundle.pk).update(created_at=created_at)  # created_at is set on insert
    bundle.refresh_from_db()
    return bundle


def _storage(tenant, now=NOW) -> dict:
    rows = usage_rows(start=date(2026, 11, 18), end=date(2026, 11, 20), group_by=("day", "kind"), tenants=[tenant],
                      now=now)
    return {row["day"]: row["storage_gb_months"] for row in rows if row["kind"] == "storage"}


def test_a_kept_bundle_is_charged_per_day_written_or_not(tenant, other_tenant):
    bundle = _bundle(tenant, size=30 * 10**9, created_at=NOW - timedelta(days=2))
    # 30 GB for 2 days of a 30-day month: 2 GB-months in all, from 10:30 on the 18th.
    expected = {"2026-11-18": "0.5625", "2026-11-19": "1.0000", "2026-11-20": "0.4375"}
    assert _storage(tenant) == expected  # nothing written yet: all of it from the bundle's truth
    ledger.settle_run(now=NOW)
    entries = UsageEntry.objects.filter(item=f"bundle:{bundle.id}")
    assert sorted(entries.values_list("piece", flat=True)) == ["2026-11-18", "2026-11-19"]  # whole days only
    assert {(e.kind, e.tenant_id, e.job_id) for e in entries} == {("storage", tenant.id, None)}
    assert _storage(tenant) == expected  # the 18th and 19th written, today added up to now
    assert _storage(other_tenant) == {}
    total = usage_rows(start=date(2026, 11, 18), end=date(2026, 11, 20), group_by=("kind",), tenants=[tenant], now=NOW)
    assert next(row["cost"] for row in total if row["kind"] == "storage") == "0.20"  # 2 GB-months at 0.10


def test_a_deleted_bundle_stops_counting_and_what_was_written_past_it_is_taken_back(tenant):
    bundle = _bundle(tenant, size=30 * 10**9, created_at=NOW - timedelta(days=2))
    ledger.settle_run(now=NOW)
    Bundle.objects.filter(pk=bundle.pk).update(deleted_at=NOW - timedelta(days=1))  # learnt after the sweep
    later = NOW + timedelta(days=3)
    ledger.settle_run(now=later)
    assert _storage(tenant, later) == {"2026-11-18": "0.5625", "2026-11-19": "0.4375"}
    assert UsageEntry.objects.filter(item=f"bundle:{bundle.id}", correction=True).exists()
    # Settled to its deletion: nothing is pending for it any more, and a later sweep writes nothing.
    assert [p for p in ledger.unwritten(later) if p.item == f"bundle:{bundle.id}"] == []
    assert ledger.settle_run(now=later + timedelta(days=1))["entries"] == 0


def test_a_jobs_usage_holds_no_bundle(tenant):
    _bundle(tenant, size=10**9, created_at=NOW - timedelta(days=1))
    assert [p.item for p in ledger.unwritten(NOW)] == [f"bundle:{Bundle.objects.get().id}"] * 2
    assert ledger.unwritten(NOW, job_ids=[]) == []
