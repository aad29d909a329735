"""The usage ledger against a scripted scenario whose cost is computed by hand, to the cent.

Tenant acme, on 2026-11-02 (UTC):
- job "pretrain", 2 whole H100s: attempt 1 admitted 08:00, preempted 10:00; attempt 2 admitted at
  09:59 (before the first had let go) and ended 14:00. The H100 costs 2.00/h, 3.00/h from noon.
  08:00-12:00 at 2 units x 2.00 = 16.00 (the minute both attempts overlap counted once);
  12:00-14:00 at 2 x 3.00 = 12.00. Job total 28.00.
- job "mig", one A100 1g.5gb MIG slice at 0.50/h from 09:00 to 11:00 the next day: 26 h = 13.00,
  15 h on the 2nd and 11 h on the 3rd.
- a checkpoint of "pretrain" of 2 GB kept 15 days (half a 30-day month) at 0.10 per GB-month: 0.10.
Tenant globex: job "tiles", one T4 time-slice share at 0.25/h, 13:00-19:00: 1.50.

acme: 28.00 + 13.00 + 0.10 = 41.10; globex: 1.50.
"""

import csv
import io
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
from django.core import mail

from quotas.models import BorrowingPause, PriceCard
from runners.jobs.models import Checkpoint, Job, JobAttempt
from runners.usage import budgets, ledger
from runners.usage.models import Budget, BudgetAlert, CloudPrice, UsageEntry
from runners.usage.selectors import usage_rows
from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment

pytestmark = pytest.mark.integration

DAY = datetime(2026, 11, 2, tzinfo=UTC)
LATER = datetime(2026, 12, 1, tzinfo=UTC)  # "now" for the scenario: everything has ended


def at(hours: float, days: int = 0) -> datetime:
    return DAY + timedelta(days=days, hours=hours)


@pytest.fixture
def scenario(db, tenant, other_tenant, owner, outsider, settings):
    settings.USAGE_STORAGE_PRICE_PER_GB_MONTH = Decimal("0.10")
    flavors = demo_cluster_with_flavors()
    h100, mig, t4 = flavors["h100-80gb"], flavors["a100-40gb-mig-1g.5gb"], flavors["t4-shared"]
    PriceCard.objects.create(flavor=h100, price_per_hour=Decimal("2.00"), effective_from=DAY - timedelta(days=30))
    PriceCard.objects.create(flavor=h100, price_per_hour=Decimal("3.00"), effective_from=at(12))
    PriceCard.objects.create(flavor=mig, price_per_hour=Decimal("0.50"), effective_from=DAY - timedelta(days=30))
    PriceCard.objects.create(flavor=t4, price_per_hour=Decimal("0.25"), effective_from=DAY - timedelta(days=30))
    CloudPrice.objects.create(flavor=h100, price_per_hour=Decimal("6.00"), effective_from=DAY - timedelta(days=30))
    acme_env = ready_environment(actor=owner, tenant=tenant)
    globex_env = ready_environment(actor=outsider, tenant=other_tenant, name="vision")

    def job(environment, name, flavor, replicas, intervals):
        made = Job.objects.create(
            tenant=environment.tenant, environment=environment, name=name, spec={"template": "pytorch-ddp"},
            flavor=flavor, replicas=replicas, gpus_per_replica=1, state="succeeded",
        )
        for number, (start, end) in enumerate(intervals, start=1):
            attempt = JobAttempt.objects.create(job=made, number=number, placement=[])
            JobAttempt.objects.filter(id=attempt.id).update(admitted_at=start, started_at=start, ended_at=end,
                                                            outcome="succeeded")
        return made

    pretrain = job(acme_env, "pretrain", h100, 2, [(at(8), at(10)), (at(9, 0) + timedelta(minutes=59), at(14))])
    slice_job = job(acme_env, "mig", mig, 1, [(at(9), at(11, 1))])
    tiles = job(globex_env, "tiles", t4, 1, [(at(13), at(19))])
    Checkpoint.objects.create(job=pretrain, step=100, uri="file:///ckpt", bytes=2 * 10**9, created_at=at(9),
                              deleted_at=at(9, 15))
    return {"pretrain": pretrain, "mig": slice_job, "tiles": tiles, "flavors": flavors}


def _by_tenant(rows):
    return {row["tenant"]: Decimal(row["cost"]) for row in rows if row["kind"] != "idle"}


NOVEMBER = {"start": date(2026, 11, 1), "end": date(2026, 11, 30)}


def test_the_cost_per_tenant_equals_the_hand_computed_value_before_and_after_settling(scenario, tenant, other_tenant):
    # Before the sweep, the query computes what is not written yet; after it, the ledger holds it all.
    unsettled = usage_rows(**NOVEMBER, group_by=("tenant",), tenants=None, now=LATER)
    assert _by_tenant(unsettled) == {"acme": Decimal("41.10"), "globex": Decimal("1.50")}

    assert ledger.settle_run(now=LATER)["entries"] > 0
    settled = usage_rows(**NOVEMBER, group_by=("tenant",), tenants=None, now=LATER)
    assert _by_tenant(settled) == {"acme": Decimal("41.10"), "globex": Decimal("1.50")}
    assert ledger.unwritten(LATER) == []
    # A second sweep finds nothing to write: nothing is counted twice.
    assert ledger.settle_run(now=LATER)["entries"] == 0


def test_the_breakdown_by_job_and_day_splits_at_midnight_and_the_price_change(scenario):
    ledger.settle_run(now=LATER)
    rows = usage_rows(**NOVEMBER, group_by=("job", "day"), tenants=None, now=LATER)
    costs = {(row["job"], row["day"], row["kind"]): (row["gpu_hours"], row["cost"]) for row in rows if row["kind"] != "idle"}
    pretrain, mig, tiles = scenario["pretrain"].id, scenario["mig"].id, scenario["tiles"].id
    assert costs[(pretrain, "2026-11-02", None)] == ("12.0000", "28.00")  # 2 units x 6 h (a storage share aside)
    assert costs[(mig, "2026-11-02", None)] == ("15.0000", "7.50")
    assert costs[(mig, "2026-11-03", None)] == ("11.0000", "5.50")
    assert costs[(tiles, "2026-11-02", None)] == ("6.0000", "1.50")
    entries = UsageEntry.objects.filter(job=scenario["pretrain"], kind="gpu")
    assert {entry.price_card.price_per_hour for entry in entries} == {Decimal("2.0000"), Decimal("3.0000")}


def test_storage_is_charged_per_gb_month_and_grouped_by_kind(scenario):
    rows = usage_rows(**NOVEMBER, group_by=("tenant", "kind"), tenants=None, now=LATER)
    storage = [row for row in rows if row["kind"] == "storage"]
    assert [(row["tenant"], row["storage_gb_months"], row["cost"]) for row in storage] == [("acme", "1.0000", "0.10")]


def test_the_cloud_reference_sits_beside_the_cost(scenario):
    rows = usage_rows(**NOVEMBER, group_by=("flavor",), tenants=None, now=LATER)
    h100 = next(row for row in rows if row["flavor"] == "h100-80gb" and row["kind"] != "idle")
    assert (h100["cost"], h100["cloud_cost"]) == ("28.00", "72.00")  # 12 unit-hours at 6.00


def test_a_tenant_sees_only_its_own_rows_and_no_idle_line(scenario, tenant):
    rows = usage_rows(**NOVEMBER, group_by=("tenant", "flavor"), tenants=[tenant], include_idle=True, now=LATER)
    assert {row["tenant"] for row in rows} == {"acme"}


def test_the_idle_line_is_capacity_less_allocation(scenario):
    h100 = scenario["flavors"]["h100-80gb"]
    from runners.usage.models import CapacityChange

    CapacityChange.objects.create(flavor=h100, capacity=16, at=at(0))
    rows = usage_rows(start=date(2026, 11, 2), end=date(2026, 11, 2), group_by=("flavor",), tenants=None,
                      include_idle=True, now=LATER)
    idle = next(row for row in rows if row["kind"] == "idle" and row["flavor"] == "h100-80gb")
    # 16 GPUs x 24 h = 384 unit-hours, 12 allocated: 372 idle; 16 x 12 h at 2.00 + 16 x 12 h at 3.00,
    # less 8 unit-hours at 2.00 and 4 at 3.00: 384 + 576 - 16 - 12 = 932.00.
    assert (idle["tenant"], idle["gpu_hours"], idle["cost"]) == (None, "372.0000", "932.00")


def test_a_later_end_is_a_correction_entry_never_an_edit(scenario):
    ledger.settle_run(now=LATER)
    tiles = scenario["tiles"]
    first = list(UsageEntry.objects.filter(job=tiles).values_list("id", "cost"))
    # The attempt turns out to have run an hour longer (it ran past a crash): 7 h = 1.75.
    JobAttempt.objects.filter(job=tiles).update(ended_at=at(20))
    ledger.settle_run(now=LATER)
    assert list(UsageEntry.objects.filter(id__in=[entry_id for entry_id, _ in first]).values_list("id", "cost")) == first
    correction = UsageEntry.objects.get(job=tiles, correction=True)
    assert correction.cost == Decimal("0.250000")
    assert _by_tenant(usage_rows(**NOVEMBER, group_by=("tenant",), tenants=None, now=LATER))["globex"] == Decimal("1.75")


def test_a_running_attempt_counts_up_to_now(scenario, tenant):
    h100 = scenario["flavors"]["h100-80gb"]
    running = Job.objects.create(tenant=tenant, environment=scenario["pretrain"].environment, name="live",
                                 spec={"template": "pytorch-ddp"}, flavor=h100, replicas=1, gpus_per_replica=1,
                                 state="running")
    attempt = JobAttempt.objects.create(job=running, number=1, placement=[])
    now = datetime(2026, 11, 20, 10, 30, tzinfo=UTC)
    JobAttempt.objects.filter(id=attempt.id).update(admitted_at=now - timedelta(hours=26))
    rows = usage_rows(start=date(2026, 11, 19), end=date(2026, 11, 20), group_by=("job", "day"), tenants=None, now=now)
    live = {row["day"]: row["cost"] for row in rows if row["job"] == running.id}
    assert live == {"2026-11-19": "46.50", "2026-11-20": "31.50"}  # 15.5 h and 10.5 h at 3.00
    # The sweep writes the whole day that has passed, never the running one.
    ledger.settle_run(now=now)
    assert set(UsageEntry.objects.filter(job=running).values_list("day", flat=True)) == {date(2026, 11, 19)}
    again = usage_rows(start=date(2026, 11, 19), end=date(2026, 11, 20), group_by=("job", "day"), tenants=None, now=now)
    assert {row["day"]: row["cost"] for row in again if row["job"] == running.id} == live
    # It ends at 11:30: the sweep then writes its last day too, and the total is the truth, counted once.
    JobAttempt.objects.filter(id=attempt.id).update(ended_at=now + timedelta(hours=1))
    later = now + timedelta(hours=5)
    ledger.settle_run(now=later)
    ledger.settle_run(now=later)
    assert ledger.unwritten(later, tenant_ids={tenant.id}) == []
    final = usage_rows(start=date(2026, 11, 19), end=date(2026, 11, 20), group_by=("job", "day"), tenants=None, now=later)
    assert {row["day"]: row["cost"] for row in final if row["job"] == running.id} == {
        "2026-11-19": "46.50", "2026-11-20": "34.50"
    }


def test_the_api_and_its_csv_agree_with_the_ledger(scenario, staff, owner, client_for):
    ledger.settle_run(now=LATER)
    api = client_for(staff)
    query = "/api/v1/usage/?start=2026-11-01&end=2026-11-30&group_by=tenant&idle=false"
    rows = api.get(query).json()
    assert {row["tenant"]: row["cost"] for row in rows} == {"acme": "41.10", "globex": "1.50"}
    assert set(rows[0]) >= {"tenant", "flavor", "job", "day", "gpu_hours", "cost", "currency"}
    assert rows[0]["flavor"] is None and rows[0]["day"] is None and rows[0]["job"] is None
    answer = api.get(query + "&format=csv")
    assert answer.status_code == 200 and answer["Content-Type"].startswith("text/csv")
    parsed = list(csv.DictReader(io.StringIO(answer.content.decode())))
    assert [(row["tenant"], row["cost"], row["gpu_hours"]) for row in parsed] == [
        (row["tenant"], row["cost"], row["gpu_hours"]) for row in rows
    ]
    # A member sees only the own tenant; naming another is a 404.
    member = client_for(owner)
    assert {row["tenant"] for row in member.get(query.replace("&idle=false", "")).json()} == {"acme"}
    assert member.get(query + "&tenant=globex").status_code == 404


@pytest.mark.parametrize("query, field", [
    ("group_by=planet", "group_by"), ("start=2026-13-01", "start"), ("start=2026-11-30&end=2026-11-01", "start"),
    ("start=2024-01-01&end=2026-11-30", "end"),
])
def test_bad_usage_queries_are_400s_naming_the_field(scenario, staff, client_for, query, field):
    answer = client_for(staff).get(f"/api/v1/usage/?{query}")
    assert answer.status_code == 400 and field in answer.json()


def test_budget_alerts_at_80_and_100_percent_mail_once_and_pause_borrowing(
    scenario, tenant, owner, django_capture_on_commit_callbacks
):
    owner.email = "owner@acme.test"
    owner.save()
    Budget.objects.create(tenant=tenant, monthly_amount=Decimal("50.00"), stop_borrowing=True)
    november = datetime(2026, 11, 30, 12, tzinfo=UTC)
    with django_capture_on_commit_callbacks(execute=True):
        assert budgets.budgets_check(now=november) == 1  # 41.10 of 50: 82%
    assert len(mail.outbox) == 1 and "80%" in mail.outbox[0].subject and mail.outbox[0].to == ["owner@acme.test"]
    assert not BorrowingPause.objects.filter(tenant=tenant).exists()
    with django_capture_on_commit_callbacks(execute=True):
        assert budgets.budgets_check(now=november) == 0
    assert len(mail.outbox) == 1  # once per threshold and month

    Budget.objects.filter(tenant=tenant).update(monthly_amount=Decimal("40.00"))
    with django_capture_on_commit_callbacks(execute=True):
        assert budgets.budgets_check(now=november) == 1
    assert BudgetAlert.objects.filter(tenant=tenant).count() == 2
    assert "100%" in mail.outbox[1].subject and "guarantee" in mail.outbox[1].body
    assert BorrowingPause.objects.filter(tenant=tenant).exists()
    # Work within the guarantee is still admitted; borrowing is not (the cycle reads the pause).
    Budget.objects.filter(tenant=tenant).update(stop_borrowing=False)
    budgets.budgets_check(now=november)
    assert not BorrowingPause.objects.filter(tenant=tenant).exists()


def test_a_paused_tenant_is_admitted_within_its_guarantee_only(scenario, tenant, owner):
    from runners.jobs import services as jobs
    from runners.scheduling import services as scheduling
    from tests.support.jobs import job_data

    h100 = scenario["flavors"]["h100-80gb"]
    give_quota(tenant, h100, guaranteed=2, max=8)
    environment = scenario["pretrain"].environment
    BorrowingPause.objects.create(tenant=tenant, reason=budgets.PAUSE_REASON)
    within = jobs.job_submit(actor=owner, data=job_data(environment, name="within", replicas=2))
    beyond = jobs.job_submit(actor=owner, data=job_data(environment, name="beyond", replicas=2))
    scheduling.cycle_run()
    within.refresh_from_db()
    beyond.refresh_from_db()
    assert within.state == "admitted" and beyond.state == "queued"
    BorrowingPause.objects.all().delete()
    scheduling.cycle_run()
    beyond.refresh_from_db()
    assert beyond.state == "admitted"


def test_a_kept_checkpoint_is_charged_up_to_now_whether_written_or_not(scenario, tenant):
    now = datetime(2026, 11, 20, 10, 30, tzinfo=UTC)
    Checkpoint.objects.create(job=scenario["mig"], step=7, uri="file:///kept", bytes=30 * 10**9,
                              created_at=now - timedelta(days=2))
    # 30 GB for 2 days of a 30-day month at 0.10 per GB-month: 0.20, from 10:30 on the 18th.
    def storage():
        rows = usage_rows(start=date(2026, 11, 18), end=date(2026, 11, 20), group_by=("day", "kind"),
                          tenants=[tenant], now=now)
        return {row["day"]: row["storage_gb_months"] for row in rows if row["kind"] == "storage"}

    before = storage()
    assert before == {"2026-11-18": "0.5625", "2026-11-19": "1.0000", "2026-11-20": "0.4375"}
    ledger.settle_run(now=now)  # the 18th and 19th written; today summed by the database
    assert storage() == before
    total = usage_rows(start=date(2026, 11, 18), end=date(2026, 11, 20), group_by=("kind",), tenants=[tenant], now=now)
    assert next(row["cost"] for row in total if row["kind"] == "storage") == "0.20"


def test_budgets_and_cloud_prices_through_the_api(scenario, tenant, staff, owner, outsider, client_for):
    admin, member, stranger = client_for(staff), client_for(owner), client_for(outsider)
    body = {"monthly_amount": "50.00", "currency": "USD", "stop_borrowing": True}
    assert member.put("/api/v1/budgets/acme/", body, format="json").status_code == 403
    assert admin.put("/api/v1/budgets/acme/", body, format="json").json()["monthly_amount"] == "50.00"
    assert member.get("/api/v1/budgets/acme/").json()["stop_borrowing"] is True
    assert stranger.get("/api/v1/budgets/acme/").status_code == 404
    refused = admin.put("/api/v1/budgets/acme/", {**body, "monthly_amount": "-1"}, format="json")
    assert refused.status_code == 400 and "monthly_amount" in refused.json()

    ledger.settle_run(now=LATER)
    budgets.budgets_check(now=datetime(2026, 11, 30, tzinfo=UTC))
    alerts = member.get("/api/v1/budget-alerts/").json()
    assert [(a["tenant"], a["threshold_pct"], a["spent"]) for a in alerts] == [("acme", 80, "41.10")]
    assert stranger.get("/api/v1/budget-alerts/").json() == []
    assert stranger.get("/api/v1/budget-alerts/?tenant=acme").status_code == 404
    assert admin.delete("/api/v1/budgets/acme/").status_code == 204
    assert member.get("/api/v1/budgets/acme/").status_code == 404

    price = {"flavor": "t4-shared", "price_per_hour": "0.35", "provider": "list price",
             "effective_from": "2026-10-01T00:00:00Z"}
    assert member.post("/api/v1/cloud-prices/", price, format="json").status_code == 403
    assert admin.post("/api/v1/cloud-prices/", price, format="json").status_code == 201
    again = admin.post("/api/v1/cloud-prices/", price, format="json")
    assert again.status_code == 400 and "effective_from" in again.json()
    assert {row["flavor"] for row in member.get("/api/v1/cloud-prices/").json()} == {"h100-80gb", "t4-shared"}


def test_a_price_card_added_for_the_past_reprices_with_corrections(scenario, staff, client_for):
    ledger.settle_run(now=LATER)
    tiles = scenario["tiles"]
    # From 16:00 on the day, the T4 share costs 1.00: 13:00-16:00 at 0.25, 16:00-19:00 at 1.00 = 3.75.
    PriceCard.objects.create(flavor=scenario["flavors"]["t4-shared"], price_per_hour=Decimal("1.00"),
                             effective_from=at(16))
    client_for(staff).post("/api/v1/cloud-prices/", {"flavor": "t4-shared", "price_per_hour": "2.00",
                                                     "effective_from": "2026-10-01T00:00:00Z"}, format="json")
    ledger.settle_run(now=LATER)
    rows = usage_rows(**NOVEMBER, group_by=("tenant",), tenants=None, now=LATER)
    globex = next(row for row in rows if row["tenant"] == "globex")
    assert (globex["cost"], globex["cloud_cost"]) == ("3.75", "12.00")
    assert UsageEntry.objects.filter(job=tiles, correction=True).exists()
    assert ledger.settle_run(now=LATER)["entries"] == 0
