"""Reading usage and cost: the rows the API, the CSV export, the pages and the budgets all share.

A row is {"tenant", "flavor", "job", "endpoint", "day", "kind", "gpu_hours", "storage_gb_months",
"cost", "cloud_cost", "currency"}; the keys not grouped by are None. GPU hours are flavor-unit
hours (a MIG slice or a time-slice share is one unit of its flavor). The cluster's idle capacity is
a line of its own (tenant None, kind "idle"), shown to staff only: capacity-hours of each flavor
the ledger finds unallocated, at the flavor's price.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import date, datetime, timedelta
from decimal import Decimal

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Sum
from django.utils import timezone

from common.errors import NotFound
from quotas.models import ResourceFlavor
from runners.usage import ledger
from runners.usage.models import BudgetAlert, CapacityChange, EntryKind, UsageEntry
from tenants.models import Tenant
from tenants.selectors import tenant_list

GROUPS = ("tenant", "flavor", "job", "day", "kind")
IDLE = "idle"


def visible_tenants(user: AbstractBaseUser, slug: str | None = None) -> list[Tenant] | None:
    """The tenants a user may read usage of (None: every tenant, for staff); a slug narrows it (404 if not theirs)."""
    if slug:
        tenant = tenant_list(user=user).filter(slug=slug).first()
        if tenant is None:
            raise NotFound(f"No tenant {slug}.")
        return [tenant]
    return None if user.is_staff else list(tenant_list(user=user))


def _key(group_by: tuple[str, ...], *, tenant, flavor, job, endpoint, day, kind) -> tuple:
    return (
        tenant if "tenant" in group_by else None,
        flavor if "flavor" in group_by else None,
        job if "job" in group_by else None,
        endpoint if "job" in group_by else None,
        day if "day" in group_by else None,
        kind if "kind" in group_by or kind == IDLE else None,
    )


class _Total:
    __slots__ = ("gpu_seconds", "gb_seconds", "cost", "cloud_cost")

    def __init__(self) -> None:
        self.gpu_seconds = self.gb_seconds = self.cost = Decimal(0)
        self.cloud_cost: Decimal | None = None

    def add(self, gpu_seconds, gb_seconds, cost, cloud_cost) -> None:
        self.gpu_seconds += gpu_seconds or 0
        self.gb_seconds += gb_seconds or 0
        self.cost += cost or 0
        if cloud_cost is not None:
            self.cloud_cost = (self.cloud_cost or Decimal(0)) + cloud_cost


def usage_rows(*, start: date, end: date, group_by: tuple[str, ...], tenants: list[Tenant] | None,
               include_idle: bool = False, now: datetime | None = None, job_ids: list[int] | None = None) -> list[dict]:
    """Usage from `start` to `end` (UTC days, both included), grouped; `tenants` None means all of them.

    `job_ids` narrows it to those jobs (a job's page, an endpoint's replicas): nothing else is read.
    """
    now = now or timezone.now()
    tenant_ids = None if tenants is None else {tenant.id for tenant in tenants}
    slugs = dict(Tenant.objects.values_list("id", "slug"))
    flavors = dict(ResourceFlavor.objects.values_list("id", "name"))
    totals: dict[tuple, _Total] = defaultdict(_Total)

    entries = UsageEntry.objects.filter(day__gte=start, day__lte=end)
    if tenant_ids is not None:
        entries = entries.filter(tenant_id__in=tenant_ids)
    if job_ids is not None:
        entries = entries.filter(job_id__in=job_ids)
    fields = ["currency"]
    fields += ["tenant_id"] if "tenant" in group_by else []
    fields += ["flavor_id"] if "flavor" in group_by else []
    fields += ["job_id", "endpoint_id"] if "job" in group_by else []
    fields += ["day"] if "day" in group_by else []
    fields += ["kind"] if "kind" in group_by else []
    for row in entries.values(*fields).annotate(
        gpu=Sum("gpu_seconds"), gb=Sum("gb_seconds"), cost=Sum("cost"), cloud=Sum("cloud_cost")
    ).order_by():
        # An endpoint's replicas are jobs; their usage is the endpoint's.
        job = row.get("job_id") if row.get("endpoint_id") is None else None
        key = _key(group_by, tenant=slugs.get(row.get("tenant_id")), flavor=flavors.get(row.get("flavor_id")),
                   job=job, endpoint=row.get("endpoint_id"), day=row.get("day"), kind=row.get("kind"))
        totals[(*key, row["currency"])].add(row["gpu"], row["gb"], row["cost"], row["cloud"])

    pending = [piece for piece in ledger.unwritten(now, tenant_ids=tenant_ids, job_ids=job_ids)
               if start <= piece.day <= end]
    for piece in pending:
        key = _key(group_by, tenant=slugs.get(piece.tenant_id), flavor=flavors.get(piece.flavor_id),
                   job=piece.job_id if piece.endpoint_id is None else None, endpoint=piece.endpoint_id,
                   day=piece.day, kind=piece.kind)
        totals[(*key, piece.currency)].add(piece.gpu_seconds, piece.gb_seconds, piece.cost, piece.cloud_cost)

    if include_idle and tenants is None and job_ids is None:
        for (flavor_id, day, currency), (idle_seconds, cost) in idle_capacity(start, end, pending, now).items():
            key = _key(group_by, tenant=None, flavor=flavors.get(flavor_id), job=None, endpoint=None, day=day, kind=IDLE)
            totals[(*key, currency)].add(idle_seconds, 0, cost, None)

    rows = []
    for (tenant, flavor, job, endpoint, day, kind, currency), total in totals.items():
        rows.append({
            "tenant": tenant, "flavor": flavor, "job": job, "endpoint": endpoint,
            "day": day.isoformat() if day else None, "kind": kind,
            "gpu_hours": _places(total.gpu_seconds / ledger.SECONDS_PER_HOUR, "0.0001"),
            "storage_gb_months": _places(total.gb_seconds / ledger.SECONDS_PER_MONTH, "0.0001"),
            "cost": _places(total.cost, "0.01"),
            "cloud_cost": _places(total.cloud_cost, "0.01") if total.cloud_cost is not None else None,
            "currency": currency,
        })
    rows.sort(key=lambda row: (row["day"] or "", row["kind"] == IDLE, row["tenant"] or "", row["flavor"] or "",
                               row["job"] or 0, row["endpoint"] or 0, row["kind"] or "", row["currency"]))
    return rows


def _places(value: Decimal, places: str) -> str:
    return str(value.quantize(Decimal(places)))


def idle_capacity(start: date, end: date, pending: list, now: datetime) -> dict[tuple, tuple[Decimal, Decimal]]:
    """Per flavor, day and currency: unit-seconds of capacity no attempt held, and what they cost."""
    prices = ledger.Prices()
    # A range that ends after today ends now (9999-12-31 has no day after it to take the midnight of).
    window_start = ledger.midnight(start)
    window_end = now if end >= ledger.utc_day(now) else min(now, ledger.midnight(end + timedelta(days=1)))
    allocated: dict[tuple, Decimal] = defaultdict(Decimal)
    for row in (
        UsageEntry.objects.filter(kind=EntryKind.GPU, day__gte=start, day__lte=end)
        .values("flavor_id", "day", "price_card_id").annotate(gpu=Sum("gpu_seconds")).order_by()
    ):
        allocated[(row["flavor_id"], row["day"], row["price_card_id"])] += row["gpu"]
    for piece in pending:
        if piece.kind == EntryKind.GPU:
            allocated[(piece.flavor_id, piece.day, piece.price_card_id)] += piece.gpu_seconds

    changes: dict[int, list[CapacityChange]] = defaultdict(list)
    for change in CapacityChange.objects.filter(at__lt=window_end).order_by("flavor_id", "at"):
        changes[change.flavor_id].append(change)
    out: dict[tuple, list[Decimal]] = defaultdict(lambda: [Decimal(0), Decimal(0)])
    for flavor_id, history in changes.items():
        # Capacity is known from its first record on; before it, nothing is claimed idle.
        for index, change in enumerate(history):
            stop = history[index + 1].at if index + 1 < len(history) else window_end
            a, b = max(change.at, window_start), min(stop, window_end)
            if a >= b or not change.capacity:
                continue
            capacity: dict[tuple, Decimal] = defaultdict(Decimal)
            for seg_start, seg_end, card in prices.segments(flavor_id, a, b):
                capacity[(ledger.utc_day(seg_start), card)] += ledger._seconds(seg_start, seg_end) * change.capacity
            for (day, card), seconds in capacity.items():
                total = out[(flavor_id, day, card.id if card else None, card.currency if card else ledger._currency())]
                total[0] += seconds
                total[1] = card.price_per_hour if card else Decimal(0)
    result: dict[tuple, tuple[Decimal, Decimal]] = defaultdict(lambda: (Decimal(0), Decimal(0)))
    for (flavor_id, day, card_id, currency), (seconds, price) in out.items():
        idle_seconds = max(Decimal(0), seconds - allocated.get((flavor_id, day, card_id), Decimal(0)))
        seen_seconds, seen_cost = result[(flavor_id, day, currency)]
        result[(flavor_id, day, currency)] = (
            seen_seconds + idle_seconds, seen_cost + idle_seconds * price / ledger.SECONDS_PER_HOUR
        )
    return dict(result)


def month_bounds(today: date) -> tuple[date, date]:
    first = today.replace(day=1)
    following = (first + timedelta(days=32)).replace(day=1)
    return first, following - timedelta(days=1)


def tenant_month_cost(tenant: Tenant, currency: str, *, now: datetime | None = None) -> Decimal:
    """What the tenant has spent this month (UTC) in one currency, its open work counted up to now."""
    now = now or timezone.now()
    first, last = month_bounds(ledger.utc_day(now))
    rows = usage_rows(start=first, end=last, group_by=("tenant",), tenants=[tenant], now=now)
    return sum((Decimal(row["cost"]) for row in rows if row["currency"] == currency), Decimal(0))


def budget_alerts(tenants: list[Tenant] | None):
    alerts = BudgetAlert.objects.select_related("tenant")
    return alerts if tenants is None else alerts.filter(tenant__in=tenants)


def current_alert(tenant: Tenant, *, now: datetime | None = None) -> BudgetAlert | None:
    """The highest threshold the tenant's month has crossed (for the banner on its pages)."""
    month = ledger.utc_day(now or timezone.now()).replace(day=1)
    return BudgetAlert.objects.filter(tenant=tenant, month=month).order_by("-threshold").first()
