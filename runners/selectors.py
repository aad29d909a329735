"""Reads of environments, the inventory and partition changes, with the one visibility rule for each.

- Environments and jobs are tenant data: a user sees those of the tenants they belong to
  (staff all); anyone else's is NotFound.
- The inventory is the operator's view of the cluster: pools, nodes, GPUs and
  partition changes are staff's, and every read of them here refuses anyone
  else with NotFound, so the pages, their fragments and the API cannot forget
  it. What a tenant may know of the cluster is each flavor's capacity, which
  names no node and no other tenant (``ResourceFlavor.capacity``, on /api/v1/flavors/).
"""

import math

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Count, Max, Min, Prefetch, QuerySet

from portal.errors import NotFound
from runners.backends.base import BackendError
from runners.models import (
    JOB_HOLDING_STATES,
    Environment,
    EnvironmentState,
    Gpu,
    Job,
    JobMetric,
    Node,
    NodePool,
    PartitionChange,
    PartitionProfile,
)
from runners.nvidia import gpu_operator
from runners.registry import get_backend
from tenants.models import Tenant
from tenants.selectors import tenant_list


def is_inventory_reader(user: AbstractBaseUser) -> bool:
    """Who may see pools, nodes, GPUs and partition changes: staff."""
    return bool(user.is_authenticated and user.is_staff)


def _require_staff(user: AbstractBaseUser) -> None:
    if not is_inventory_reader(user):
        raise NotFound("No such page.")


def node_pool_list(*, user: AbstractBaseUser) -> QuerySet[NodePool]:
    """Every node pool with its profile and how many nodes and GPUs it has."""
    _require_staff(user)
    return (
        NodePool.objects.select_related("partition_profile")
        .annotate(node_count=Count("nodes", distinct=True), gpu_count=Count("nodes__gpus", distinct=True))
        .order_by("name")
    )


def node_pool_get(*, user: AbstractBaseUser, pool_id: int) -> NodePool:
    try:
        return node_pool_list(user=user).get(id=pool_id)
    except (NodePool.DoesNotExist, ValueError):
        raise NotFound("No such node pool.") from None


def node_pool_nodes(*, user: AbstractBaseUser, pool: NodePool) -> QuerySet[Node]:
    """The pool's nodes, each with its GPUs in index order."""
    _require_staff(user)
    return pool.nodes.order_by("name").prefetch_related(Prefetch("gpus", queryset=Gpu.objects.order_by("index")))


def node_pool_profiles(*, user: AbstractBaseUser, pool: NodePool) -> QuerySet[PartitionProfile]:
    """Profiles that can be applied to the pool: those for its GPU model."""
    _require_staff(user)
    profiles = PartitionProfile.objects.order_by("name")
    return profiles.filter(gpu_model=pool.gpu_model) if pool.gpu_model else profiles


def partition_change_latest(*, user: AbstractBaseUser, pool: NodePool) -> PartitionChange | None:
    _require_staff(user)
    return pool.partition_changes.select_related("profile", "created_by").order_by("-created_at", "-id").first()


def partition_change_latest_by_pool(*, user: AbstractBaseUser) -> dict[int, PartitionChange]:
    """The newest change of every pool that had one, by pool id."""
    _require_staff(user)
    latest: dict[int, PartitionChange] = {}
    for change in PartitionChange.objects.select_related("profile").order_by("pool_id", "-created_at", "-id"):
        latest.setdefault(change.pool_id, change)
    return latest


def node_pool_first_gpus(*, user: AbstractBaseUser) -> dict[int, Gpu]:
    """The first GPU (by node name, then index) of every pool that has one, by pool id."""
    _require_staff(user)
    first: dict[int, Gpu] = {}
    for gpu in Gpu.objects.filter(node__pool__isnull=False).select_related("node").order_by("node__pool_id", "node__name", "index"):
        first.setdefault(gpu.node.pool_id, gpu)
    return first


# The API lists below are empty for anyone but staff, so a list says nothing and an id is a 404.


def node_list(*, user: AbstractBaseUser) -> QuerySet[Node]:
    """Every node with its pool and GPUs (staff; nothing for anyone else)."""
    nodes = Node.objects.select_related("pool").prefetch_related(Prefetch("gpus", queryset=Gpu.objects.order_by("index")))
    return nodes.order_by("name") if is_inventory_reader(user) else nodes.none()


def node_pool_api_list(*, user: AbstractBaseUser) -> QuerySet[NodePool]:
    """Node pools with their nodes (staff; nothing for anyone else)."""
    pools = NodePool.objects.prefetch_related("nodes").select_related("partition_profile").order_by("name")
    return pools if is_inventory_reader(user) else pools.none()


def partition_change_list(*, user: AbstractBaseUser) -> QuerySet[PartitionChange]:
    """Partition changes, newest first (staff; nothing for anyone else: their steps name every tenant's work)."""
    changes = PartitionChange.objects.select_related("pool", "profile").order_by("-created_at", "-id")
    return changes if is_inventory_reader(user) else changes.none()


# --- Partition profiles: a public catalog of shapes, applied by staff ---------------


def partition_profile_configs(profile: PartitionProfile) -> dict:
    """The NVIDIA GPU Operator configuration that applying the profile amounts to.

    The same rendering the Kubernetes backend applies to each node
    (`gpu_operator.node_partition_request`); a label shown as None is removed.
    """
    request = gpu_operator.node_partition_request(
        name=profile.name, kind=profile.kind, gpu_model_name=profile.gpu_model, layout=profile.layout,
        replicas=profile.replicas,
    )
    return {
        "node_labels": dict(request.node_labels),
        "mig_parted_config": request.mig_parted_config_text(),
        "device_plugin_config": request.device_plugin_config,
    }



def partition_profile_list() -> QuerySet[PartitionProfile]:
    return PartitionProfile.objects.prefetch_related("node_pools").order_by("gpu_model", "name")


# --- Environments ----------------------------------------------------------------


def environment_list(
    *, user: AbstractBaseUser, tenant: Tenant | None = None, state: str | None = None, include_deleted: bool = False
) -> QuerySet[Environment]:
    """Environments of the user's tenants, newest first."""
    queryset = Environment.objects.filter(tenant__in=tenant_list(user=user)).select_related("tenant", "created_by")
    if tenant is not None:
        queryset = queryset.filter(tenant=tenant)
    if state is not None:
        queryset = queryset.filter(state=state)
    elif not include_deleted:
        queryset = queryset.exclude(state=EnvironmentState.DELETED)
    return queryset.order_by("-created_at", "-id")


def environment_get(*, user: AbstractBaseUser, environment_id: int) -> Environment:
    try:
        return environment_list(user=user, include_deleted=True).get(id=environment_id)
    except (Environment.DoesNotExist, ValueError):
        raise NotFound("No such environment.") from None


# --- Jobs --------------------------------------------------------------------------


def job_list(*, user: AbstractBaseUser, tenant: str | None = None, state: str | None = None) -> QuerySet[Job]:
    queryset = Job.objects.filter(tenant__in=tenant_list(user=user)).select_related("tenant", "flavor", "environment")
    if tenant:
        queryset = queryset.filter(tenant__slug=tenant)
    if state:
        queryset = queryset.filter(state=state)
    return queryset


def job_get(*, user: AbstractBaseUser, job_id) -> Job:
    try:
        return job_list(user=user).get(id=job_id)
    except (Job.DoesNotExist, ValueError, TypeError):
        raise NotFound("No such job.") from None


def tenant_flavor_usage(*, tenant: Tenant) -> dict[int, int]:
    """Units of each flavor (by id) the tenant's jobs hold now."""
    usage: dict[int, int] = {}
    for flavor_id, replicas, gpus in Job.objects.filter(tenant=tenant, state__in=JOB_HOLDING_STATES).values_list(
        "flavor_id", "replicas", "gpus_per_replica"
    ):
        usage[flavor_id] = usage.get(flavor_id, 0) + replicas * gpus
    return usage


def job_page(job: Job) -> dict:
    """What the job page draws: placement by node, events, checkpoints, the loss series and a log tail."""
    attempts = list(job.attempts.order_by("number"))
    current = attempts[-1] if attempts else None
    nodes: dict[str, dict] = {}
    if current is not None:
        gpu_counts = dict(Gpu.objects.filter(node__name__in={r["node"] for r in current.placement}).values_list(
            "node__name").annotate(count=Count("id")))
        for replica in current.placement:
            node = nodes.setdefault(replica["node"], {"name": replica["node"], "gpus": {}, "replicas": []})
            node["replicas"].append(replica)
            for index in replica["gpus"]:
                node["gpus"][index] = replica
        for name, node in nodes.items():
            node["slots"] = [
                {"index": index, "replica": node["gpus"].get(index)} for index in range(gpu_counts.get(name, 0))
            ]
    metrics = job_metric_series(job, points=CHART_POINTS)
    started = next((a for a in reversed(attempts) if a.started_at), None)
    log, log_error = "", ""
    if started is not None:
        try:
            log = job_log_tail(job, started.number, 0, tail=40)
        except BackendUnavailable as exc:
            log_error = str(exc)
    return {
        "job": job, "attempts": attempts, "current": current, "nodes": list(nodes.values()),
        "events": list(job.events.all()), "checkpoints": list(job.checkpoints.order_by("-step")[:20]),
        "series": metrics["series"], "steps_recorded": metrics["steps_recorded"], "log": log, "log_error": log_error,
    }



# The loss chart and the metrics API never need more points than this: a read costs the same at
# step 10 and at step 10,000,000.
CHART_POINTS = 400
MAX_SERIES_POINTS = 5000


class BackendUnavailable(Exception):
    """The cluster could not be read now (the API answers 503 naming the backend)."""


def job_log_tail(job: Job, attempt: int, rank: int, *, tail: int) -> str:
    """The last lines one replica wrote, read from the cluster; BackendUnavailable when it cannot be read."""
    backend = get_backend()
    try:
        return backend.job_logs(job.id, attempt, rank, tail=tail)
    except BackendError as exc:
        raise BackendUnavailable(f"The {backend.name} backend cannot be read now: {exc}") from None


def job_metric_series(job: Job, *, points: int = CHART_POINTS, first_step: int | None = None,
                      last_step: int | None = None) -> dict:
    """The job's loss curve as recorded, at most `points` points spread evenly over the steps.

    One record per step (the newest attempt's when a step was trained twice). Reads only the
    chosen steps through the (job, step) index, so the cost depends on `points`, not on how many
    steps the job has run.
    """
    rows = JobMetric.objects.filter(job=job)
    if first_step is not None:
        rows = rows.filter(step__gte=first_step)
    if last_step is not None:
        rows = rows.filter(step__lte=last_step)
    bounds = rows.aggregate(low=Min("step"), high=Max("step"))
    if bounds["low"] is None:
        return {"series": [], "steps_recorded": 0, "first_step": None, "last_step": None}
    low, high = bounds["low"], bounds["high"]
    stride = max(1, math.ceil((high - low + 1) / max(1, points - 1)))
    chosen = rows if stride == 1 else rows.filter(step__in=sorted({*range(low, high + 1, stride), high}))
    newest: dict[int, dict] = {}
    for record in chosen.order_by("step", "attempt").values("step", "attempt", "loss", "samples_per_s", "at"):
        newest[record["step"]] = record
    series = [
        {"attempt": r["attempt"], "step": r["step"], "loss": r["loss"], "samples_per_s": r["samples_per_s"],
         "time": r["at"]}
        for r in newest.values()
    ]
    return {"series": series, "steps_recorded": high - low + 1, "first_step": low, "last_step": high}


def environment_live_jobs(environment: Environment) -> list[Job]:
    """The environment's jobs not yet final: what deleting it cancels."""
    from runners.models import JOB_FINAL_STATES

    return list(Job.objects.filter(environment=environment).exclude(state__in=JOB_FINAL_STATES).order_by("id"))
