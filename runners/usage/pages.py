"""What the usage pages read: utilization over time, cost per day and flavor, the costliest jobs,
endpoints and workspaces, the tenant's workspaces with their idle time, idle allocations, one job's or endpoint's cost, and the cluster's summary for staff.

Every cost here comes from `selectors.usage_rows`, the rows the API and its CSV export give, so a
page never disagrees with the export (the one exception, an endpoint's cost over the hours its
request samples cover, prices those hours with the ledger's own pieces). Utilization comes from
UtilizationSample, each row weighted by the readings it averages, since a downsampled row stands
for many. The charts' coordinates are the frontend's (frontend/charts.py); this module hands it
the series to draw.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import connection
from django.db.models import Avg, DateTimeField, ExpressionWrapper, F, FloatField, Func, Max, QuerySet, Sum, Value

from runners.inference.models import EndpointSample, InferenceEndpoint
from runners.jobs.models import Job, JobAttempt, JobState
from runners.usage import ledger, sampling
from runners.usage.models import EntryKind, Source, UtilizationSample
from runners.usage.selectors import IDLE, month_bounds, usage_rows
from tenants.models import Tenant

# Bucket widths a utilization chart may use: the narrowest that keeps it under MAX_BUCKETS points.
BUCKETS = [timedelta(seconds=seconds) for seconds in
           (5, 15, 30, 60, 300, 900, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400)]
MAX_BUCKETS = 200
# Buckets start here, as the downsampling's do, so a chart's hour is the stored hour.
EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
STORAGE = "checkpoint storage"  # the cost charts' name for what checkpoints cost to keep
TOP_ITEMS = 10


# --- Ranges -----------------------------------------------------------------------------------


def this_month(now: datetime) -> tuple[date, date]:
    return month_bounds(ledger.utc_day(now))


def day_span(start: date, end: date, now: datetime) -> tuple[datetime, datetime]:
    """The moments a range of UTC days covers, cut at now: nothing later has been measured."""
    begin = ledger.midnight(start)
    return begin, max(begin, min(now, ledger.midnight(end + timedelta(days=1))))


def days_of(start: date, end: date) -> list[date]:
    return [start + timedelta(days=offset) for offset in range((end - start).days + 1)]


def page_currency(rows: list[dict]) -> str:
    """The currency a page charts and totals: the portal's own when any row is in it, else the first found."""
    found = {row["currency"] for row in rows}
    return settings.USAGE_CURRENCY if settings.USAGE_CURRENCY in found or not found else sorted(found)[0]


# --- Utilization ------------------------------------------------------------------------------


class DateBin(Func):
    """PostgreSQL's date_bin(width, moment, origin): the start of the fixed-width bucket a moment falls in."""

    function = "date_bin"
    output_field = DateTimeField()


def bucket_for(span: timedelta) -> timedelta:
    return next((bucket for bucket in BUCKETS if span <= bucket * MAX_BUCKETS), BUCKETS[-1])


def bucket_label(bucket: timedelta) -> str:
    """A bucket's width in words: "5 minutes", "hour"."""
    seconds = int(bucket.total_seconds())
    unit, size = next((unit, size) for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1))
                      if seconds % size == 0)
    return unit if seconds == size else f"{seconds // size} {unit}s"


def _weighted_utilization() -> dict:
    return {"weighted": Sum(ExpressionWrapper(F("gpu_util_pct") * F("readings"), output_field=FloatField())),
            "readings": Sum("readings")}


def mean_utilization(samples: QuerySet[UtilizationSample]) -> float | None:
    """The mean GPU utilization (%) of these samples, each weighted by the readings it stands for."""
    row = samples.filter(gpu_util_pct__isnull=False).aggregate(**_weighted_utilization())
    return row["weighted"] / row["readings"] if row["readings"] else None


def _sources(samples: QuerySet[UtilizationSample]) -> dict:
    """Whether the samples include simulated GPUs' readings and real ones (a page says which it shows)."""
    found = set(samples.order_by().values_list("source", flat=True).distinct())
    return {"simulated": Source.SIMULATED in found, "measured": bool(found - {Source.SIMULATED})}


def tenant_utilization(tenant: Tenant, begin: datetime, end: datetime) -> dict:
    """The tenant's mean utilization over all its devices per bucket of [begin, end), and over the whole span."""
    samples = UtilizationSample.objects.filter(tenant=tenant, at__gte=begin, at__lt=end)
    bucket = bucket_for(end - begin)
    rows = (
        samples.filter(gpu_util_pct__isnull=False)
        .annotate(bucket=DateBin(Value(bucket), "at", Value(EPOCH)))
        .values("bucket").annotate(**_weighted_utilization()).order_by("bucket")
    )
    # A bucket is drawn at its middle, the moment its mean best stands for.
    points = [(row["bucket"] + bucket / 2, row["weighted"] / row["readings"]) for row in rows if row["readings"]]
    return {"points": points, "bucket_label": bucket_label(bucket), "mean": mean_utilization(samples),
            **_sources(samples)}


def replica_utilization(job_ids: list[int], begin: datetime, end: datetime) -> dict:
    """Per replica (job, attempt, rank): its GPUs' mean utilization (%) and summed memory (GiB) per bucket.

    Averaged per device and bucket in the database (at most MAX_BUCKETS buckets, however long the
    job ran), then a replica's devices combined: they count alike however often each was read.
    """
    bucket = bucket_for(end - begin)
    rows = (
        UtilizationSample.objects.filter(job_id__in=job_ids, at__gte=begin, at__lt=end)
        .annotate(bucket=DateBin(Value(bucket), "at", Value(EPOCH)))
        .values("job_id", "attempt", "rank", "device", "bucket")
        .annotate(utilization=Avg("gpu_util_pct"), memory=Avg("memory_used_mib"), simulated=Max("source"))
        .order_by()
    )
    replicas: dict[tuple[int, int, int], dict] = {}
    simulated = measured = False
    for row in rows:
        simulated |= row["simulated"] == Source.SIMULATED
        measured |= row["simulated"] != Source.SIMULATED
        replica = replicas.setdefault((row["job_id"], row["attempt"], row["rank"]),
                                      {"utilization": defaultdict(list), "memory": defaultdict(float)})
        if row["utilization"] is not None:
            replica["utilization"][row["bucket"]].append(row["utilization"])
        if row["memory"] is not None:
            replica["memory"][row["bucket"]] += row["memory"] / 1024
    middle = bucket / 2
    return {
        "replicas": [
            {"job": job_id, "attempt": attempt, "rank": rank,
             "utilization": sorted((slot + middle, sum(values) / len(values))
                                   for slot, values in replica["utilization"].items()),
             "memory_gib": sorted((slot + middle, value) for slot, value in replica["memory"].items())}
            for (job_id, attempt, rank), replica in sorted(replicas.items())
        ],
        "bucket_label": bucket_label(bucket), "simulated": simulated, "measured": measured,
    }


# --- Cost -------------------------------------------------------------------------------------


@dataclass
class Spend:
    """Usage rows added up in one currency: all their cost, and the GPU work's hours, cost and cloud reference.

    The cloud reference prices GPU-hours only, so the saving beside it is against the GPU cost.
    """

    currency: str
    gpu_hours: Decimal = Decimal(0)
    cost: Decimal = Decimal(0)
    gpu_cost: Decimal = Decimal(0)
    cloud_cost: Decimal | None = None

    def add(self, row: dict) -> None:
        self.cost += Decimal(row["cost"])
        # Rows grouped by kind say it; otherwise GPU work is what has a flavor (storage has none).
        if (row["kind"] == EntryKind.GPU) if row["kind"] else row["flavor"] is not None:
            self.gpu_hours += Decimal(row["gpu_hours"])
            self.gpu_cost += Decimal(row["cost"])
            if row["cloud_cost"] is not None:
                self.cloud_cost = (self.cloud_cost or Decimal(0)) + Decimal(row["cloud_cost"])

    @property
    def saving(self) -> Decimal | None:
        return None if self.cloud_cost is None else self.cloud_cost - self.gpu_cost


def workspace_jobs(tenant: Tenant, job_ids) -> dict[int, int]:
    """{job id: workspace id} for those of ``job_ids`` that are the tenant's workspaces' starts."""
    return dict(Job.objects.filter(tenant=tenant, kind=Job.Kind.WORKSPACE, id__in=[i for i in job_ids if i])
                .values_list("id", "spec__workspace__workspace_id"))


def items(rows: list[dict], workspaces: dict[int, int] | None = None) -> list[dict]:
    """Rows grouped by job and kind as one entry per job, endpoint or workspace and currency: {"kind", "id",
    "spend"}. An endpoint's replicas count under their endpoint; a workspace's starts (``workspaces``: job id to
    workspace id) under their workspace."""
    workspaces = workspaces or {}
    found: dict[tuple, dict] = {}
    for row in rows:
        if row["endpoint"]:
            kind, item_id = "endpoint", row["endpoint"]
        elif row["job"] in workspaces:
            kind, item_id = "workspace", workspaces[row["job"]]
        else:
            kind, item_id = "job", row["job"]
        item = found.setdefault((kind, item_id, row["currency"]),
                                {"kind": kind, "id": item_id, "spend": Spend(row["currency"])})
        item["spend"].add(row)
    return list(found.values())


def top_items(tenant: Tenant, start: date, end: date, now: datetime, *, user, limit: int = TOP_ITEMS) -> list[dict]:
    """The tenant's costliest jobs, endpoints and workspaces over the range, each named (only the tenant's own are
    looked up; a workspace ``user`` may not see keeps its cost and loses its name)."""
    from runners.workspaces.models import Workspace
    from runners.workspaces.selectors import workspace_list

    rows = usage_rows(start=start, end=end, group_by=("job", "kind"), tenants=[tenant], now=now)
    found = items(rows, workspace_jobs(tenant, {row["job"] for row in rows}))
    found.sort(key=lambda item: (-item["spend"].cost, item["kind"], item["id"] or 0))
    found = found[:limit]
    names = {
        "job": dict(Job.objects.filter(tenant=tenant, id__in=[i["id"] for i in found if i["kind"] == "job"])
                    .values_list("id", "name")),
        "endpoint": dict(InferenceEndpoint.objects.filter(
            tenant=tenant, id__in=[i["id"] for i in found if i["kind"] == "endpoint"]).values_list("id", "name")),
        "workspace": dict(workspace_list(user=user, tenant=tenant).filter(
            id__in=[i["id"] for i in found if i["kind"] == "workspace"]).values_list("id", "name")),
    }
    existing = set(Workspace.objects.filter(tenant=tenant, id__in=[i["id"] for i in found if i["kind"] == "workspace"])
                   .values_list("id", flat=True))
    for item in found:
        item["name"] = names[item["kind"]].get(item["id"])
        # A workspace without a name here is deleted, or another member's private one.
        item["deleted"] = item["kind"] == "workspace" and item["id"] not in existing
    return found


def tenant_workspaces(tenant: Tenant, start: date, end: date, now: datetime, *, user) -> list[dict]:
    """The tenant's workspaces ``user`` may see, beside its jobs and endpoints: each with what it cost over the
    range (one Spend per currency), how long it has been idle now (while it runs; JupyterLab's last activity, a
    kernel seen busy, or its start) and the idle window it is stopped after."""
    from runners.workspaces import services as workspace_services
    from runners.workspaces.models import WorkspaceState
    from runners.workspaces.selectors import workspace_list

    workspaces = list(workspace_list(user=user, tenant=tenant).order_by("name"))
    if not workspaces:
        return []
    jobs = dict(Job.objects.filter(tenant=tenant, kind=Job.Kind.WORKSPACE,
                                   spec__workspace__workspace_id__in=[workspace.id for workspace in workspaces])
                .values_list("id", "spec__workspace__workspace_id"))
    spend: dict[int, dict[str, Spend]] = defaultdict(dict)
    if jobs:
        for row in usage_rows(start=start, end=end, group_by=("job", "kind"), tenants=[tenant], now=now,
                              job_ids=list(jobs)):
            spend[jobs[row["job"]]].setdefault(row["currency"], Spend(row["currency"])).add(row)
    listed = []
    for workspace in workspaces:
        since = workspace_services.idle_since(workspace) if workspace.state == WorkspaceState.READY else None
        listed.append({"workspace": workspace, "costs": list(spend[workspace.id].values()),
                       "idle_for": (now - since) if since else None,
                       "idle_limit": workspace_services.idle_limit(workspace)})
    return listed


def daily_by_flavor(tenant: Tenant, start: date, end: date, now: datetime) -> dict:
    """Per day and flavor: GPU-hours and cost (the cost in the page's currency), as stacked bars draw them.

    Checkpoint storage has no flavor; it is a segment of its own in the cost chart.
    """
    rows = usage_rows(start=start, end=end, group_by=("flavor", "day"), tenants=[tenant], now=now)
    currency = page_currency(rows)
    hours: dict[str, dict[date, float]] = defaultdict(lambda: defaultdict(float))
    cost: dict[str, dict[date, float]] = defaultdict(lambda: defaultdict(float))
    for row in rows:
        label, day = row["flavor"] or STORAGE, date.fromisoformat(row["day"])
        hours[label][day] += float(row["gpu_hours"])
        if row["currency"] == currency:
            cost[label][day] += float(row["cost"])
    # One order for both charts, storage last, so a flavor has the same colour in each.
    labels = sorted(set(hours) | set(cost), key=lambda label: (label == STORAGE, label))
    totals: dict[str, Spend] = {}
    for row in rows:
        totals.setdefault(row["currency"], Spend(row["currency"])).add(row)
    return {
        "days": days_of(start, end), "currency": currency, "rows": rows,
        "totals": [totals[key] for key in sorted(totals, key=lambda key: (key != currency, key))],
        "other_currencies": sorted({row["currency"] for row in rows} - {currency}),
        "hours": [(label, dict(hours.get(label, {}))) for label in labels],
        "cost": [(label, dict(cost.get(label, {}))) for label in labels],
    }


def flavor_month(tenant: Tenant, now: datetime) -> dict[str, list[dict]]:
    """This month's usage rows per flavor name (one per currency), for the quota page's "in use" column."""
    first, last = this_month(now)
    by_flavor: dict[str, list[dict]] = defaultdict(list)
    for row in usage_rows(start=first, end=last, group_by=("flavor",), tenants=[tenant], now=now):
        if row["flavor"]:
            by_flavor[row["flavor"]].append(row)
    return dict(by_flavor)


def job_cost(job: Job, now: datetime) -> list[dict]:
    """What a training job has cost over its life, its checkpoints' keeping included (one entry per currency).

    An endpoint's replica is counted under its endpoint, so it has none of its own.
    """
    rows = usage_rows(start=ledger.utc_day(job.submitted_at), end=ledger.utc_day(now), group_by=("job", "kind"),
                      tenants=[job.tenant], now=now, job_ids=[job.id])
    return [item for item in items(rows) if item["kind"] == "job" and item["id"] == job.id]


def endpoint_cost(endpoint: InferenceEndpoint, now: datetime) -> list[dict]:
    """What an endpoint's replicas have cost since it was deployed (one entry per currency)."""
    rows = usage_rows(start=ledger.utc_day(endpoint.created_at), end=ledger.utc_day(now), group_by=("job", "kind"),
                      tenants=[endpoint.tenant], now=now,
                      job_ids=list(endpoint.replicas.values_list("job_id", flat=True)))
    return [item for item in items(rows) if item["kind"] == "endpoint" and item["id"] == endpoint.id]


def workspace_usage(workspace, now: datetime) -> dict:
    """What a workspace has cost over all its starts (one Spend per currency), and its GPUs' mean utilization over
    the last hour (None without readings)."""
    job_ids = list(Job.objects.filter(tenant=workspace.tenant, kind=Job.Kind.WORKSPACE,
                                      spec__workspace__workspace_id=workspace.id).values_list("id", flat=True))
    spend: dict[str, Spend] = {}
    for row in usage_rows(start=ledger.utc_day(workspace.created_at), end=ledger.utc_day(now), group_by=("job", "kind"),
                          tenants=[workspace.tenant], now=now, job_ids=job_ids):
        spend.setdefault(row["currency"], Spend(row["currency"])).add(row)
    samples = UtilizationSample.objects.filter(job_id__in=job_ids, at__gte=now - timedelta(hours=1))
    return {"costs": list(spend.values()), "utilization": mean_utilization(samples), "jobs": len(job_ids)}


def allocation_cost(job_ids: list[int], begin: datetime, end: datetime) -> dict[str, Decimal]:
    """What these jobs' attempts cost between two moments, per currency, priced as the ledger prices them.

    The ledger's rows are whole days; a window of hours is the ledger's own pieces up to its end
    less those up to its start.
    """
    attempts = list(JobAttempt.objects.filter(job_id__in=job_ids, admitted_at__lt=end)
                    .exclude(ended_at__lte=begin).select_related("job"))
    prices = ledger.Prices()
    cost: dict[str, Decimal] = defaultdict(Decimal)
    for row in ledger.attempt_rows(attempts):
        for piece in ledger.attempt_pieces(row, end, prices):
            cost[piece.currency] += piece.cost
        for piece in ledger.attempt_pieces(row, begin, prices):
            cost[piece.currency] -= piece.cost
    return dict(cost)


_REQUESTS = """
SELECT min(at), max(at), sum(requests_per_s * extract(epoch FROM at - previous))
FROM (SELECT at, requests_per_s, lag(at) OVER (ORDER BY at) AS previous FROM {table} WHERE endpoint_id = %s) AS samples
"""


def endpoint_requests(endpoint: InferenceEndpoint) -> dict | None:
    """Requests the endpoint answered over the span its samples cover, and what each 1,000 cost there.

    A sample's rate holds for the interval since the sample before it, so the requests are the sum
    of rate x interval (in SQL: an endpoint keeps a day of samples, one every few seconds). None
    before two samples.
    """
    with connection.cursor() as cursor:
        cursor.execute(_REQUESTS.format(table=EndpointSample._meta.db_table), [endpoint.id])
        begin, end, requests = cursor.fetchone()
    if requests is None or begin >= end:
        return None
    requests = Decimal(requests)
    job_ids = list(endpoint.replicas.values_list("job_id", flat=True))
    costs = [
        {"currency": currency, "cost": cost,
         "per_thousand": (cost * 1000 / requests).quantize(Decimal("0.0001")) if requests else None}
        for currency, cost in sorted(allocation_cost(job_ids, begin, end).items())
    ]
    return {"begin": begin, "end": end, "requests": requests.quantize(Decimal(1)), "costs": costs}


# --- Idle allocations -------------------------------------------------------------------------


def tenant_idle(tenant: Tenant, *, threshold_pct: float, window_s: float) -> list[dict]:
    """The tenant's allocations idle for the whole window, each with its endpoint (if a replica) and whether it is stopping."""
    idle = sampling.idle_allocations(tenant_ids={tenant.id}, threshold_pct=threshold_pct, window_s=window_s)
    endpoints = InferenceEndpoint.objects.in_bulk([item.endpoint_id for item in idle if item.endpoint_id])
    rows = []
    for item in idle:
        endpoint = endpoints.get(item.endpoint_id)
        stopping = endpoint.stop_requested_at is not None if endpoint else item.job.state == JobState.CANCELLING
        rows.append({"allocation": item, "endpoint": endpoint, "stopping": stopping})
    return rows


# --- The cluster ------------------------------------------------------------------------------


def cluster_summary(start: date, end: date, now: datetime) -> dict:
    """Allocation, utilization, idle capacity and cost of the whole cluster over a range, and per tenant.

    Allocation is the unit-hours attempts held over the capacity-hours the idle line counts from
    (allocated + idle: the ledger's idle line is capacity less allocation). The cost of a useful
    GPU-hour is everything the GPUs cost (the tenants' GPU cost and the idle line's) over the
    allocated GPU-hours times the utilization: what a GPU-hour of real work cost at this usage.
    """
    rows = usage_rows(start=start, end=end, group_by=("tenant", "kind"), tenants=None, include_idle=True, now=now)
    currency = page_currency(rows)
    begin, stop = day_span(start, end, now)
    samples = UtilizationSample.objects.filter(at__gte=begin, at__lt=stop)
    utilization = mean_utilization(samples)
    slugs = dict(Tenant.objects.values_list("id", "slug"))
    by_tenant = {
        slugs.get(row["tenant_id"]): row["weighted"] / row["readings"]
        for row in samples.filter(gpu_util_pct__isnull=False).values("tenant_id")
        .annotate(**_weighted_utilization()).order_by() if row["readings"]
    }

    allocated = sum((Decimal(row["gpu_hours"]) for row in rows if row["kind"] == EntryKind.GPU), Decimal(0))
    idle_rows = [row for row in rows if row["kind"] == IDLE]
    idle_hours = sum((Decimal(row["gpu_hours"]) for row in idle_rows), Decimal(0))
    capacity = allocated + idle_hours
    tenants: dict[tuple[str, str], dict] = {}
    for row in rows:
        if row["kind"] != IDLE:
            tenants.setdefault((row["tenant"], row["currency"]), {
                "tenant": row["tenant"], "spend": Spend(row["currency"]), "utilization": by_tenant.get(row["tenant"]),
            })["spend"].add(row)

    gpu_cost = sum((Decimal(row["cost"]) for row in rows
                    if row["kind"] in (EntryKind.GPU, IDLE) and row["currency"] == currency), Decimal(0))
    useful_hours = allocated * Decimal(str(round(utilization, 4))) / 100 if utilization is not None else Decimal(0)
    return {
        "currency": currency,
        "allocated_hours": allocated, "idle_hours": idle_hours, "capacity_hours": capacity,
        "allocation_pct": float(allocated * 100 / capacity) if capacity else None,
        "utilization_pct": utilization, **_sources(samples),
        "idle": [{"currency": row["currency"], "gpu_hours": Decimal(row["gpu_hours"]), "cost": Decimal(row["cost"])}
                 for row in idle_rows],
        "gpu_cost": gpu_cost, "useful_hours": useful_hours,
        "per_useful_hour": (gpu_cost / useful_hours).quantize(Decimal("0.01")) if useful_hours else None,
        "tenants": sorted(tenants.values(), key=lambda tenant: (-tenant["spend"].cost, tenant["tenant"] or "")),
    }
