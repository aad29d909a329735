"""The ledger's writers against each other, each race forced in one order by a lock the test holds.

A sweep (or an attempt's settling) runs in a thread with its own database connection; the test
stops it at a point it controls (an item's advisory lock, or a settlement row another connection
is inserting), changes the world with a second connection, then lets it go.
"""

import threading
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection, connections

from quotas.models import PriceCard
from quotas.services import price_set
from runners.jobs.models import Job, JobAttempt
from runners.usage import ledger
from runners.usage.models import Settlement, UsageEntry
from runners.usage.selectors import usage_rows
from tests.support import invariants
from tests.support.jobs import demo_cluster_with_flavors, ready_environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

DAY = datetime(2026, 11, 2, tzinfo=UTC)
LATER = datetime(2026, 12, 1, tzinfo=UTC)


def at(hours: float, days: int = 0) -> datetime:
    return DAY + timedelta(days=days, hours=hours)


@pytest.fixture
def world(tenant, owner):
    flavors = demo_cluster_with_flavors()
    t4 = flavors["t4-shared"]
    PriceCard.objects.create(flavor=t4, price_per_hour=Decimal("0.25"), effective_from=DAY - timedelta(days=30))
    return {"t4": t4, "environment": ready_environment(actor=owner, tenant=tenant)}


def job(world, name, units, start, end=None) -> Job:
    made = Job.objects.create(
        tenant=world["environment"].tenant, environment=world["environment"], name=name,
        spec={"template": "pytorch-ddp"}, flavor=world["t4"], replicas=units, gpus_per_replica=1,
        state="succeeded" if end else "running",
    )
    attempt = JobAttempt.objects.create(job=made, number=1, placement=[])
    JobAttempt.objects.filter(id=attempt.id).update(admitted_at=start, started_at=start, ended_at=end,
                                                    outcome="succeeded" if end else "")
    return made


class Background(threading.Thread):
    """A call in a thread of its own (so on a database connection of its own)."""

    def __init__(self, call):
        super().__init__(daemon=True)
        self.call, self.result, self.error = call, None, None
        self.start()

    def run(self):
        try:
            self.result = self.call()
        except BaseException as exc:  # handed to the test by finish()
            self.error = exc
        finally:
            connection.close()

    def finish(self):
        self.join(60)
        assert not self.is_alive(), "the background call never finished"
        if self.error:
            raise self.error
        return self.result


def side_connection():
    return connections.create_connection("default")


def hold_item_lock(side, item: str) -> None:
    """Take the lock a ledger writer takes on an item, on another connection (released by closing it)."""
    with side.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock(hashtext(%s))", [f"usage:{item}"])


def wait_for_waiters(count: int, *, unless=lambda: False) -> None:
    """Until `count` lock requests wait in the database (or `unless()` holds): the blocked calls are where wanted."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            # This database's sessions only: other test runs share the server.
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND wait_event_type = 'Lock'")
            if cursor.fetchone()[0] >= count or unless():
                return
        time.sleep(0.05)
    raise AssertionError(f"{count} lock waits never showed up")


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
        sweep = Background(lambda: ledger.settle_run(now=LATER))
        wait_for_waiters(1)  # the sweep has found the item and waits for its lock
        price_set(actor=staff, flavor=world["t4"], price_per_hour=Decimal("1.00"), currency="USD",
                  effective_from=at(16))
    finally:
        side.close()
    sweep.finish()
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
        sweep = Background(lambda: ledger.settle_run(now=LATER))
        wait_for_waiters(1)
        card = Background(lambda: price_set(actor=staff, flavor=world["t4"], price_per_hour=Decimal("1.00"),
                                            currency="USD", effective_from=at(16)))
        wait_for_waiters(2, unless=lambda: not card.is_alive())
        side.rollback()
    finally:
        side.close()
    sweep.finish()
    card.finish()
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
        sweep = Background(lambda: ledger.settle_run(now=now))
        wait_for_waiters(1)
        JobAttempt.objects.filter(id=ending.id).update(ended_at=at(9, days=1), outcome="succeeded")
        ledger.settle_jobs([ending.job_id], now=now)
    finally:
        side.close()
    sweep.finish()
    # 16 h on the 2nd and 9 h on the 3rd, written once: no piece taken back, the settlement still closed.
    entries = UsageEntry.objects.filter(item=f"attempt:{ending.id}")
    assert sum(entry.gpu_seconds for entry in entries) == 25 * 3600
    assert not entries.filter(gpu_seconds__lt=0).exists()
    settlement = Settlement.objects.get(kind="attempt", object_id=ending.id)
    assert (settlement.closed, settlement.upto) == (True, at(9, days=1))
    assert invariants.check_ledger() == []
