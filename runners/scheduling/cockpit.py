"""Reads for the staff cockpit and the cross-tenant queue: the whole cluster at a glance.

Staff only: anyone else gets NotFound, as the inventory's own reads do. Every figure comes from a
fixed number of queries (jobs, their open attempts, quotas, GPUs), whatever the number of jobs or
nodes, and is counted as the cycle counts it: a job holds `replicas x gpus_per_replica` units of its
flavor while it is in a holding state, and which of it is borrowed is the scheduler's own rule
(`runners.scheduler.admission.preemption.borrowed_units`: the newest work past the guarantee).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Prefetch
from django.utils import timezone

from common.errors import NotFound
from quotas.models import BorrowingPause, PriceCard, Quota, ResourceFlavor
from quotas.selectors import flavor_kubernetes_resource
from runners.clusters.models import Gpu, Node, NodePool, PartitionChange
from runners.clusters.services import gpu_units
from runners.environments.models import Environment, EnvironmentState
from runners.jobs.attempts import open_attempts
from runners.jobs.models import JOB_HOLDING_STATES, NOT_YET_SEEN_REASON, Job, JobState
from runners.scheduler.admission import FlavorQuota, RunningWorkload, TenantQuota
from runners.scheduler.admission.preemption import borrowed_units
from runners.scheduling.models import SchedulerCycle
from runners.scheduling.services import fragmentation_now

# What the queue page lists: waiting work and work that holds GPUs.
QUEUE_STATES = [JobState.QUEUED, *JOB_HOLDING_STATES]


def _require_staff(user: AbstractBaseUser) -> None:
    if not (user.is_authenticated and user.is_staff):
        raise NotFound("No such page.")


def _epoch(moment) -> float:
    return moment.timestamp() if moment else 0.0


def _live_jobs(states) -> list[Job]:
    return list(
        Job.objects.filter(state__in=states)
        .select_related("tenant", "flavor", "serving_replica__endpoint")
        .order_by("id")
    )


def _borrowed(holding: list[Job], quotas: list[Quota]) -> dict[int, int]:
    """Units each holding job borrows beyond its tenant's guarantee, by job id (only borrowers)."""
    by_tenant: dict[str, dict[str, FlavorQuota]] = defaultdict(dict)
    for quota in quotas:
        by_tenant[quota.tenant.slug][quota.flavor.name] = FlavorQuota(quota.guaranteed, quota.max)
    workloads = [
        RunningWorkload(id=str(job.id), tenant=job.tenant.slug, units_by_flavor={job.flavor.name: job.units},
                        started_at_s=_epoch(job.started_at or job.state_changed_at))
        for job in holding
    ]
    tenants = {slug: TenantQuota(slug, flavors) for slug, flavors in by_tenant.items()}
    return {int(job_id): sum(units.values()) for job_id, units in borrowed_units(workloads, tenants).items()}


# --- The queue -----------------------------------------------------------------------


@dataclass
class QueueRow:
    job: Job
    borrowed_units: int  # held beyond the guarantee (running), or what admitting it would borrow (queued)
    age_s: float
    endpoint: object = None  # the inference endpoint a serving replica belongs to

    @property
    def borrowing(self) -> bool:
        return self.borrowed_units > 0

    @property
    def unseen(self) -> bool:
        """Queued, and the cycle has not looked at it yet (one it set aside, say as unfit, is in no line)."""
        return self.job.state == JobState.QUEUED and self.job.reason == NOT_YET_SEEN_REASON


def queue(*, user: AbstractBaseUser, tenant: str | None = None, state: str | None = None) -> list[QueueRow]:
    """Every queued and holding job of every tenant: the queued ones first, in the cycle's order.

    A queued job's place is the one the last cycle wrote (`queue_position`); jobs it has not seen
    yet follow in the order it takes them in (submitted, then id). `tenant` (a slug) and `state`
    narrow the list; place in line and borrowing are still counted over everyone.
    """
    _require_staff(user)
    jobs = _live_jobs(QUEUE_STATES)
    quotas = list(Quota.objects.select_related("tenant", "flavor"))
    holding = [job for job in jobs if job.state != JobState.QUEUED]
    borrowed = _borrowed(holding, quotas)
    held: Counter[tuple[int, int]] = Counter()
    for job in holding:
        held[job.tenant_id, job.flavor_id] += job.units
    guaranteed = {(quota.tenant_id, quota.flavor_id): quota.guaranteed for quota in quotas}
    now = timezone.now()
    rows = []
    for job in jobs:
        if job.state == JobState.QUEUED:
            key = (job.tenant_id, job.flavor_id)
            beyond = max(0, held[key] + job.units - guaranteed.get(key, 0))
            units = min(job.units, beyond)
        else:
            units = borrowed.get(job.id, 0)
        replica = getattr(job, "serving_replica", None) if job.kind == Job.Kind.SERVING else None
        rows.append(QueueRow(job=job, borrowed_units=units, age_s=(now - job.submitted_at).total_seconds(),
                             endpoint=replica.endpoint if replica else None))
    rows.sort(key=_queue_order)
    if tenant:
        rows = [row for row in rows if row.job.tenant.slug == tenant]
    if state:
        rows = [row for row in rows if row.job.state == state]
    return rows


def _queue_order(row: QueueRow) -> tuple:
    """Queued jobs first, by the place the last cycle gave them (new ones last, as the cycle takes them);
    then the work holding GPUs, oldest first."""
    job = row.job
    if job.state == JobState.QUEUED:
        return (0, job.queue_position is None, job.queue_position or 0, job.submitted_at, job.id)
    return (1, False, 0, job.submitted_at, job.id)


def queue_job_get(*, user: AbstractBaseUser, job_id) -> Job:
    """Any tenant's job, for staff (the queue's cancel button)."""
    _require_staff(user)
    try:
        return Job.objects.select_related("tenant").get(id=int(job_id))
    except (Job.DoesNotExist, ValueError, TypeError):
        raise NotFound("No such job.") from None


# --- The cockpit ---------------------------------------------------------------------


@dataclass
class GpuView:
    """One GPU: how it is cut, how many units it offers and holds, and the jobs on it."""

    gpu: Gpu
    units: int
    used: int = 0
    jobs: list[Job] = field(default_factory=list)
    drawing: object = None  # the page's picture of it (frontend.drawings), set by the view

    @property
    def busy(self) -> bool:
        return self.used > 0


def cockpit(*, user: AbstractBaseUser) -> dict:
    """The cluster at a glance: capacity by flavor and pool, every GPU with its jobs, the queue and
    borrowing by tenant, partition changes in flight, failing environments and fragmentation."""
    _require_staff(user)
    flavors = list(ResourceFlavor.objects.order_by("gpu_model", "kind", "mig_profile", "name"))
    by_shape = {(flavor.kind, flavor.gpu_model, flavor.mig_profile): flavor for flavor in flavors}
    jobs = _live_jobs(QUEUE_STATES)
    holding = [job for job in jobs if job.state != JobState.QUEUED]
    queued = [job for job in jobs if job.state == JobState.QUEUED]
    attempts = open_attempts(holding)
    quotas = list(Quota.objects.select_related("tenant", "flavor").order_by("tenant__slug", "flavor__name"))
    borrowed = _borrowed(holding, quotas)

    # Where each holding job sits, as its open attempt was placed.
    on_gpu: dict[tuple[str, int], list[tuple[Job, dict]]] = defaultdict(list)
    for job in holding:
        attempt = attempts.get(job.id)
        for replica in attempt.placement if attempt else ():
            for index in replica.get("gpus", []):
                on_gpu[replica["node"], index].append((job, replica))

    gpus_in_order = Prefetch("gpus", queryset=Gpu.objects.order_by("index"))
    pools: list[tuple[NodePool | None, list[Node]]] = [
        (pool, list(pool.nodes.all()))
        for pool in NodePool.objects.order_by("name").prefetch_related(
            Prefetch("nodes", queryset=Node.objects.order_by("name").prefetch_related(gpus_in_order))
        )
    ]
    loose = list(Node.objects.filter(pool__isnull=True).order_by("name").prefetch_related(gpus_in_order))
    if loose:
        pools.append((None, loose))
    pool_rows = []
    for pool, nodes in pools:
        node_rows, shapes = [], Counter()
        for node in nodes:
            views = []
            for gpu in node.gpus.all():
                placed = on_gpu.get((node.name, gpu.index), [])
                offered = gpu_units(gpu)
                units = sum(offered.values())
                views.append(GpuView(gpu=gpu, units=units, used=min(units, len(placed)),
                                     jobs=list(dict.fromkeys(job for job, _ in placed))))
                if node.schedulable:
                    shapes.update(offered)
            node_rows.append({"node": node, "gpus": views})
        units = sum(view.units for row in node_rows if row["node"].schedulable for view in row["gpus"])
        used = sum(view.used for row in node_rows if row["node"].schedulable for view in row["gpus"])
        pool_rows.append({
            "pool": pool, "nodes": node_rows, "units": units, "used": used, "free": max(0, units - used),
            "cordoned": sum(1 for node in nodes if not node.schedulable),
            "flavors": [
                {"name": by_shape[shape].name if shape in by_shape else "/".join(part for part in shape if part),
                 "units": count}
                for shape, count in sorted(shapes.items())
            ],
        })

    held_by_flavor: Counter[int] = Counter()
    queued_by_flavor: Counter[int] = Counter()
    for job in holding:
        held_by_flavor[job.flavor_id] += job.units
    for job in queued:
        queued_by_flavor[job.flavor_id] += job.units
    flavor_rows = [
        {"flavor": flavor, "capacity": flavor.capacity, "allocated": held_by_flavor[flavor.id],
         "free": max(0, flavor.capacity - held_by_flavor[flavor.id]), "queued": queued_by_flavor[flavor.id]}
        for flavor in flavors
    ]

    return {
        "flavors": flavor_rows,
        "pools": pool_rows,
        "tenants": _tenant_rows(holding, queued, quotas, borrowed),
        "queue_length": len(queued),
        "holding": len(holding),
        "partitions": list(
            PartitionChange.objects.exclude(state__in=PartitionChange.FINISHED)
            .select_related("pool", "profile", "created_by").order_by("created_at", "id")
        ),
        "failing_environments": list(
            Environment.objects.filter(state=EnvironmentState.FAILED).select_related("tenant")
            .order_by("-state_changed_at", "-id")
        ),
        "cycle": SchedulerCycle.objects.filter(id=1).first(),
        "fragmentation": fragmentation_now(),
    }


def _tenant_rows(holding: list[Job], queued: list[Job], quotas: list[Quota], borrowed: dict[int, int]) -> list[dict]:
    """Per tenant and flavor: guarantee, max, units held, of them borrowed, and what waits."""
    cells: dict[tuple[int, int], dict] = {}
    paused = dict(BorrowingPause.objects.values_list("tenant_id", "reason"))

    def cell(tenant, flavor) -> dict:
        return cells.setdefault((tenant.id, flavor.id), {
            "tenant": tenant, "flavor": flavor, "guaranteed": 0, "max": 0, "held": 0, "borrowed": 0,
            "queued_jobs": 0, "queued_units": 0, "paused": paused.get(tenant.id),
        })

    for quota in quotas:
        row = cell(quota.tenant, quota.flavor)
        row["guaranteed"], row["max"] = quota.guaranteed, quota.max
    for job in holding:
        row = cell(job.tenant, job.flavor)
        row["held"] += job.units
        row["borrowed"] += borrowed.get(job.id, 0)
    for job in queued:
        row = cell(job.tenant, job.flavor)
        row["queued_jobs"] += 1
        row["queued_units"] += job.units
    rows = [row for row in cells.values() if row["held"] or row["queued_jobs"] or row["guaranteed"] or row["max"]]
    return sorted(rows, key=lambda row: (row["tenant"].slug, row["flavor"].name))


def _resource(flavor: ResourceFlavor) -> str:
    try:
        return flavor_kubernetes_resource(flavor)
    except ValueError:  # a model the GPU catalog does not know: no resource name to show
        return ""


def flavor_table(*, user: AbstractBaseUser) -> list[dict]:
    """Every flavor with its units (capacity, held, free), its Kubernetes resource and its price cards,
    newest first, the one in force now marked."""
    _require_staff(user)
    now = timezone.now()
    held: Counter[int] = Counter()
    for flavor_id, replicas, gpus in Job.objects.filter(state__in=JOB_HOLDING_STATES).values_list(
        "flavor_id", "replicas", "gpus_per_replica"
    ):
        held[flavor_id] += replicas * gpus
    flavors = ResourceFlavor.objects.order_by("gpu_model", "kind", "mig_profile", "name").prefetch_related(
        Prefetch("prices", queryset=PriceCard.objects.order_by("-effective_from"))
    )
    rows = []
    for flavor in flavors:
        cards = list(flavor.prices.all())
        in_force = next((card for card in cards if card.effective_from <= now), None)
        rows.append({
            "flavor": flavor, "capacity": flavor.capacity, "allocated": held[flavor.id],
            "free": max(0, flavor.capacity - held[flavor.id]), "resource": _resource(flavor),
            "cards": cards, "in_force": in_force,
        })
    return rows


def cockpit_summary(*, user: AbstractBaseUser) -> dict:
    """The few counts the staff dashboard shows above its link to the cockpit (a handful of queries)."""
    _require_staff(user)
    return {
        "queued": Job.objects.filter(state=JobState.QUEUED).count(),
        "holding": Job.objects.filter(state__in=JOB_HOLDING_STATES).count(),
        "failing_environments": Environment.objects.filter(state=EnvironmentState.FAILED).count(),
        "partitions": PartitionChange.objects.exclude(state__in=PartitionChange.FINISHED).count(),
        "borrowing_paused": BorrowingPause.objects.count(),
    }
