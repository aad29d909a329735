"""Usage at the edges: an attempt with no end, a cloud price in another currency, the sweep's batches and
queries, dates at the ends of the calendar, budget currencies and a workload that stopped reporting."""

from datetime import timedelta
from decimal import Decimal

import pytest
import redis
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from quotas.models import PriceCard
from runners.jobs.models import Job, JobAttempt
from runners.usage import ledger, sampling
from runners.usage.models import CloudPrice, Settlement, UsageEntry, UtilizationSample
from runners.usage.selectors import usage_rows
from tests.support import invariants
from tests.support.jobs import demo_cluster_with_flavors, ready_environment
from tests.support.usage import DAY, LATER, at, job_with_attempts

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

NOVEMBER = {"start": DAY.date().replace(day=1), "end": DAY.date().replace(day=30)}


@pytest.fixture
def world(tenant, owner):
    flavors = demo_cluster_with_flavors()
    h100 = flavors["h100-80gb"]
    PriceCard.objects.create(flavor=h100, price_per_hour=Decimal("2.00"), effective_from=DAY - timedelta(days=30))
    return {"h100": h100, "flavors": flavors, "environment": ready_environment(actor=owner, tenant=tenant)}


def job(world, name, units, intervals, state="succeeded") -> Job:
    return job_with_attempts(world["environment"], world["h100"], name, units, intervals, state)


def gpu_hours(made: Job) -> str:
    rows = usage_rows(**NOVEMBER, group_by=("job",), tenants=None, now=LATER)
    return next(row["gpu_hours"] for row in rows if row["job"] == made.id and row["kind"] != "idle")


def test_an_earlier_attempt_with_no_end_is_counted_until_its_successor_was_admitted(world):
    # Attempt 1 from 08:00 lost its end; attempt 2 was admitted at 10:00 and ended at 14:00: 2 units x 6 h.
    made = job(world, "resumed", 2, [(at(8), None), (at(10), at(14))])
    assert gpu_hours(made) == "12.0000"
    ledger.settle_run(now=LATER)
    assert gpu_hours(made) == "12.0000"
    assert sum(e.gpu_seconds for e in UsageEntry.objects.filter(job=made)) == 12 * 3600
    # Counted to its successor's admission, the first attempt is settled for good: no sweep counts it again.
    first = made.attempts.get(number=1)
    assert Settlement.objects.filter(kind="attempt", object_id=first.id, closed=True, upto=at(10)).exists()
    assert ledger.settle_run(now=LATER) == {"items": 0, "entries": 0, "more": False}


def test_a_cloud_price_in_another_currency_is_not_summed_beside_the_cost(world):
    made = job(world, "priced", 1, [(at(8), at(10))])
    CloudPrice.objects.create(flavor=world["h100"], price_per_hour=Decimal("900"), currency="JPY",
                              effective_from=DAY - timedelta(days=30))
    row = next(row for row in usage_rows(**NOVEMBER, group_by=("job",), tenants=None, now=LATER)
               if row["job"] == made.id)
    assert (row["cost"], row["currency"], row["cloud_cost"]) == ("4.00", "USD", None)
    ledger.settle_run(now=LATER)
    assert UsageEntry.objects.get(job=made).cloud_cost is None


def test_the_sweep_reads_and_writes_a_batch_at_a_time_and_stops_when_its_time_is_spent(world):
    made = [job(world, f"j{i}", 1, [(at(8), at(9))]) for i in range(5)]
    # No time left after the first batch: it stops there and says more is to come; the next ones go on.
    assert ledger.settle_run(now=LATER, batch=2, budget_s=0) == {"items": 2, "entries": 2, "more": True}
    assert ledger.settle_run(now=LATER, batch=2, budget_s=0) == {"items": 2, "entries": 2, "more": True}
    assert ledger.settle_run(now=LATER, batch=2, budget_s=0) == {"items": 1, "entries": 1, "more": True}
    assert ledger.settle_run(now=LATER, batch=2, budget_s=0) == {"items": 0, "entries": 0, "more": False}
    assert UsageEntry.objects.filter(job__in=made).count() == 5


def test_taking_back_pieces_costs_the_same_queries_for_one_attempt_or_many(world):
    def settle_shrunk(count: int) -> int:
        made = [job(world, f"n{count}-{i}", 1, [(at(8), at(10, days=1))]) for i in range(count)]
        ledger.settle_run(now=LATER)
        # Each turns out to have ended on its first day: its second day's piece is taken back.
        JobAttempt.objects.filter(job__in=made).update(ended_at=at(20))
        with CaptureQueriesContext(connection) as queries:
            ledger.settle_run(now=LATER)
        assert UsageEntry.objects.filter(job__in=made, gpu_seconds__lt=0).count() == 2 * count  # its two days
        return len(queries)

    assert settle_shrunk(1) == settle_shrunk(6)


def test_usage_to_the_last_day_of_the_calendar_is_an_answer_not_a_500(world, staff, client_for):
    job(world, "any", 1, [(at(8), at(10))])
    answer = client_for(staff).get("/api/v1/usage/?end=9999-12-31")
    assert answer.status_code == 200, answer.content
    assert client_for(staff).get("/api/v1/usage/?start=9999-12-01&end=9999-12-31&group_by=day").json() == []


@pytest.mark.parametrize("query", ["end=0001-01-01T00:00:00Z", "end=0001-01-01T00:30:00%2B01:00",
                                   "start=0001-01-01T00:00:00Z&end=0001-01-01T01:00:00Z"])
def test_utilization_at_the_first_moment_of_the_calendar_is_a_400_naming_the_field(world, owner, client_for,
                                                                                    query):
    made = job(world, "mine", 1, [(at(8), at(10))])
    answer = client_for(owner).get(f"/api/v1/utilization/?job={made.id}&{query}")
    assert answer.status_code in (200, 400), answer.content
    if answer.status_code == 400:
        assert set(answer.json()) & {"start", "end"}


@pytest.mark.parametrize("currency, status", [("ABC", 400), ("XYZ", 400), ("usd", 400), ("JPY", 200), ("EUR", 200)])
def test_a_budget_currency_is_an_iso_4217_code(world, staff, client_for, currency, status):
    body = {"monthly_amount": "50.00", "currency": currency, "stop_borrowing": False}
    answer = client_for(staff).put("/api/v1/budgets/acme/", body, format="json")
    assert answer.status_code == status, answer.content
    if status == 400:
        assert "currency" in answer.json()


def test_a_cloud_price_currency_is_an_iso_4217_code(world, staff, client_for):
    price = {"flavor": "h100-80gb", "price_per_hour": "6.00", "currency": "QQQ", "effective_from": "2026-10-01T00:00:00Z"}
    answer = client_for(staff).post("/api/v1/cloud-prices/", price, format="json")
    assert answer.status_code == 400 and "currency" in answer.json()


def test_a_workload_that_stopped_reporting_is_idle(world):
    now = timezone.now()
    hung = job(world, "hung", 1, [(now - timedelta(hours=2), None)], state="running")
    busy = job(world, "busy", 1, [(now - timedelta(hours=2), None)], state="running")
    unmeasured = job(world, "mig", 1, [(now - timedelta(hours=2), None)], state="running")
    quiet = job(world, "quiet", 1, [(now - timedelta(hours=2), None)], state="running")
    for made, utils in ((busy, [90.0, 80.0]), (unmeasured, [None, None]), (quiet, [2.0])):
        for i, util in enumerate(utils):
            UtilizationSample.objects.create(tenant=made.tenant, job=made, attempt=1, rank=0, device="sim-1/gpu0",
                                             at=now - timedelta(minutes=5 + i), source="simulated", gpu_util_pct=util)
    # The hung trainer last reported before the window (an hour ago) and nothing since.
    UtilizationSample.objects.create(tenant=hung.tenant, job=hung, attempt=1, rank=0, device="sim-1/gpu0",
                                     at=now - timedelta(hours=1), source="simulated", gpu_util_pct=95.0)
    idle = {item.job.id: item for item in sampling.idle_allocations(window_s=1800, threshold_pct=10, now=now)}
    assert set(idle) == {hung.id, quiet.id}
    assert (idle[hung.id].samples, idle[hung.id].peak_util_pct, idle[hung.id].average_util_pct) == (0, None, None)
    assert (idle[quiet.id].samples, idle[quiet.id].peak_util_pct) == (1, 2.0)


def test_the_invariant_checker_names_an_attempt_counted_twice(world):
    made = job(world, "checked", 1, [(at(8), at(10))])
    ledger.settle_run(now=LATER)
    assert invariants.check_ledger() == []
    entry = UsageEntry.objects.get(job=made)
    entry.pk = None
    entry.save()  # the same piece written a second time
    found = invariants.check_ledger()
    assert any(line.startswith(f"attempt {made.id}/1 ") and "14400.000 GPU-seconds" in line for line in found), found
    assert any(line.startswith(f"job {made.id} ") and "counted twice" in line for line in found), found


def test_an_end_recorded_late_on_an_earlier_attempt_is_counted_once_beside_its_successor(world):
    # Attempt 1 from 08:00 lost its end; attempt 2 ran 10:00-12:00 and was settled. A cancel then ends
    # every open attempt of the job at 14:00: attempt 1 held its unit 08:00-14:00, attempt 2's hours within it.
    made = job(world, "late", 1, [(at(8), None), (at(10), at(12))])
    ledger.settle_run(now=LATER)
    assert gpu_hours(made) == "4.0000"
    JobAttempt.objects.filter(job=made, ended_at__isnull=True).update(ended_at=at(14))
    assert gpu_hours(made) == "6.0000"
    ledger.settle_jobs([made.id], now=LATER)
    assert gpu_hours(made) == "6.0000"
    assert sum(e.gpu_seconds for e in UsageEntry.objects.filter(job=made)) == 6 * 3600
    assert invariants.check_ledger() == []


def test_a_sweep_cut_short_by_its_budget_sends_the_next_one_at_once(world, settings):
    from runners.usage.tasks import usage_settle
    from tests.support.worker import purge_queue

    settings.USAGE_SETTLE_BUDGET_S = 0
    job(world, "backlog", 1, [(at(8), at(9))])
    queue = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    purge_queue()
    try:
        usage_settle()
        assert queue.llen(settings.CELERY_TASK_DEFAULT_QUEUE) == 1  # the follow-up sweep
    finally:
        purge_queue()
