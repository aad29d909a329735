"""The ledger's writers against each other, each race forced in one order by a lock the test holds.

A sweep (or an attempt's settling) runs in a thread with its own database connection; the test
stops it at a point it controls (an item's advisory lock, or a settlement row another connection
is inserting), changes the world with a second connection, then lets it go.
"""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connections

from quotas.models import PriceCard
from quotas.services import price_set
from runners.jobs.models import Job, JobAttempt
from runners.usage import ledger
from runners.usage.models import Settlement, UsageEntry
from runners.usage.selectors import usage_rows
from tests.support import invariants
from tests.support.jobs import demo_cluster_with_flavors, ready_environment
from tests.support.races import InThread, lock_waiters, wait_until
from tests.support.usage import DAY, LATER, at, job_with_attempts

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def world(tenant, owner):
    flavors = demo_cluster_with_flavors()
    t4 = flavors["t4-shared"]
    PriceCard.objects.create(flavor=t4, price_per_hour=Decimal("0.25"), effective_from=DAY - timedelta(days=30))
    return {"t4": t4, "environment": ready_environment(actor=owner, tenant=tenant)}


def job(world, name, units, start, end=None) -> Job:
    return job_with_attempts(world["environment"], world["t4"], name, units, [(start, end)],
                             "succeeded" if end else "running")


def side_connection():
    return connections.create_connection("default")


def hold_item_lock(side, item: str) -> None:
    """Take the lock a ledger writer takes on an item, on another connection (released by closing it)."""
    with side.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock(hashtext(%s))", [f"usage:{item}"])


def wait_for_waiters(count: int, *, unless=lambda: False) -> None:
    """Until `count` lock requests wait in the database (or `unless()` holds): the blocked calls are where wanted."""
    assert wait_until(lambda: lock_waiters() >= count or unless(), timeout_s=60), f"{count} lock waits never showed up"


def tenant_cost(tenant) -> Decimal:
    rows = usage_rows(start=DAY.date(), end=DAY.date() + timedelta(days=27), group_by=("tenant",), tenants=[tenant],
                      now=LATER)
    return sum((Decimal(row["cost"]) for row in rows), Decimal(0))


def test_a_past_price_card_added_while_a_sweep_waits_on_the_item_is_billed(world, tenant, staff):
    # T4 at 0.25/h, from 16:00 at 1.00/h: 13:00-16:00 at 0.25 and 16:00-19:00 at 1.00 = 3.75.
    tiles = job(world, "tiles", 1, at(13), at(19))
    side = side_connection()
    try:
        hold_item_lock(side, f"attempt:{tiles.attempts.get().id}")
        sweep = InThread(ledger.settle_run, now=LATER)
        wait_for_waiters(1)  # the sweep has found the item and waits for its lock
        price_set(actor=staff, flavor=world["t4"], price_per_hour=Decimal("1.00"), currency="USD",
                  effective_from=at(16))
    finally:
        side.close()
    sweep.outcome()
    ledger.settle_run(now=LATER)
    ledger.settle_run(now=LATER)
    assert tenant_cost(tenant) == Decimal("3.75")
    assert ledger.settle_run(now=LATER)["entries"] == 0
    assert invariants.check_ledger() == []


def test_a_price_card_committed_while_a_sweep_writes_the_item_is_billed(world, tenant, staff):
    tiles = job(world, "tiles", 1, at(13), at(19))
    attempt = tiles.attempts.get()
    side = side_connection()
    try:
        # Another connection inserts the item's settlement and holds it: the sweep's own write of it waits.
        side.set_autocommit(False)
        with side.cursor() as cursor:
            cursor.execute("INSERT INTO usage_settlement (kind, object_id, upto, closed, settled_at) "
                           "VALUES ('attempt', %s, now(), false, now())", [attempt.id])
        sweep = InThread(ledger.settle_run, now=LATER)
        wait_for_waiters(1)
        card = InThread(price_set, actor=staff, flavor=world["t4"], price_per_hour=Decimal("1.00"), currency="USD",
                        effective_from=at(16))
        wait_for_waiters(2, unless=lambda: not card.is_alive())
        side.rollback()
    finally:
        side.close()
    sweep.outcome()
    card.outcome()
    ledger.settle_run(now=LATER)
    ledger.settle_run(now=LATER)
    assert tenant_cost(tenant) == Decimal("3.75")


def test_a_sweep_that_read_an_attempt_open_leaves_its_settled_end_alone(world, tenant):
    # Two attempts open since 08:00 on the 2nd; the sweep on the 3rd at noon reads both as open. It
    # waits on the first one's lock while the second ends at 09:00 on the 3rd and is settled to its end.
    now = at(12, days=1)
    first, second = job(world, "first", 1, at(8)), job(world, "second", 1, at(8))
    a, b = first.attempts.get(), second.attempts.get()
    items = sorted([f"attempt:{a.id}", f"attempt:{b.id}"])
    blocker, ending = (a, b) if items[0] == f"attempt:{a.id}" else (b, a)
    side = side_connection()
    try:
        hold_item_lock(side, f"attempt:{blocker.id}")
        sweep = InThread(ledger.settle_run, now=now)
        wait_for_waiters(1)
        JobAttempt.objects.filter(id=ending.id).update(ended_at=at(9, days=1), outcome="succeeded")
        ledger.settle_jobs([ending.job_id], now=now)
    finally:
        side.close()
    sweep.outcome()
    # 16 h on the 2nd and 9 h on the 3rd, written once: no piece taken back, the settlement still closed.
    entries = UsageEntry.objects.filter(item=f"attempt:{ending.id}")
    assert sum(entry.gpu_seconds for entry in entries) == 25 * 3600
    assert not entries.filter(gpu_seconds__lt=0).exists()
    settlement = Settlement.objects.get(kind="attempt", object_id=ending.id)
    assert (settlement.closed, settlement.upto) == (True, at(9, days=1))
    assert invariants.check_ledger() == []
