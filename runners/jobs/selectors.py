"""Reads of jobs: a user sees those of the tenants they belong to (staff all); anyone else's is NotFound.

Logs and metrics are bounded reads: the page and its live fragment cost the same at step 10 and at
step 10,000,000.
"""

import math

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Count, Max, Min, QuerySet

from common.errors import NotFound
from runners.backends.base import BackendError
from runners.clusters.models import Gpu
from runners.clusters.registry import get_backend
from runners.environments.models import Environment
from runners.jobs.models import JOB_FINAL_STATES, JOB_HOLDING_STATES, Job, JobAttempt, JobMetric
from runners.workloads.progress import CHECKPOINT_TAG, METRIC_TAG
from tenants.models import Tenant
from tenants.selectors import tenant_list


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
    # Only an attempt that still holds its GPUs is drawn: once it ended (requeued, cancelled, done)
    # the GPUs it had may be another job's.
    current = attempts[-1] if attempts and attempts[-1].ended_at is None else None
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
            lines = without_progress_lines(job_log_tail(job, started.number, 0, tail=LOG_TAIL_READ))
            log = "\n".join(lines[-LOG_TAIL_SHOWN:])
        except BackendUnavailable as exc:
            log_error = str(exc)
    checkpoints = list(job.checkpoints.newest_first()[:20])
    return {
        "job": job, "attempts": attempts, "current": current, "nodes": list(nodes.values()),
        "events": list(job.events.all()), "checkpoints": checkpoints[:CHECKPOINTS_SHOWN],
        "older_checkpoints": checkpoints[CHECKPOINTS_SHOWN:],
        "series": metrics["series"], "steps_recorded": metrics["steps_recorded"], "log": log, "log_error": log_error,
    }



# The job page's log: the last lines a person reads, without the trainer's tagged progress lines
# (the chart and the checkpoint table show those), from a tail long enough to leave that many.
LOG_TAIL_SHOWN = 40
LOG_TAIL_READ = 200
CHECKPOINTS_SHOWN = 5
PROGRESS_PREFIXES = (f"{METRIC_TAG} ", f"{CHECKPOINT_TAG} ")


def without_progress_lines(text: str) -> list[str]:
    """The log's lines as a person reads them: those a trainer writes for the portal to parse left out."""
    return [line for line in text.splitlines() if not line.startswith(PROGRESS_PREFIXES)]


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
    return list(Job.objects.filter(environment=environment).exclude(state__in=JOB_FINAL_STATES).order_by("id"))


def jobs_placed_on_nodes(node_names: list[str]) -> dict[str, list[str]]:
    """Per node, the portal's jobs holding an open attempt placed on it (namespace/job-<id>)."""
    found: dict[str, list[str]] = {}
    wanted = set(node_names)
    for job_id, namespace, placement in JobAttempt.objects.open().values_list(
        "job_id", "job__environment__namespace", "placement"
    ):
        for node in {replica["node"] for replica in placement} & wanted:
            found.setdefault(node, []).append(f"{namespace}/job-{job_id}")
    return found
