"""Reads of jobs: a user sees those of the tenants they belong to (staff all); anyone else's is NotFound.

Logs and metrics are bounded reads: the page and its live fragment cost the same at step 10 and at
step 10,000,000.
"""

from django.contrib.auth.models import AbstractBaseUser
from django.db import connection
from django.db.models import Count, QuerySet

from common.errors import NotFound
from runners.backends.base import BackendError, CheckpointElsewhere, CheckpointFile, CheckpointGone
from runners.clusters.models import Gpu
from runners.clusters.registry import get_backend
from runners.environments.models import Environment
from runners.jobs.models import JOB_FINAL_STATES, JOB_HOLDING_STATES, Checkpoint, Job, JobAttempt, JobMetric
from runners.workloads.progress import CHECKPOINT_TAG, METRIC_TAG, STOPPED_TAG
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
    """What the job page draws: placement by node, events, checkpoints and the loss series (the log is read on its own)."""
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
    checkpoints = list(job.checkpoints.newest_first()[:20])
    return {
        "job": job, "attempts": attempts, "current": current, "nodes": list(nodes.values()),
        "events": list(job.events.all()), "checkpoints": checkpoints[:CHECKPOINTS_SHOWN],
        "older_checkpoints": checkpoints[CHECKPOINTS_SHOWN:],
        "series": metrics["series"], "steps_recorded": metrics["steps_recorded"],
    }


CHECKPOINTS_SHOWN = 5
# The tagged lines a trainer or the SDK writes for the portal to parse: metrics, checkpoints and the stop record.
PROGRESS_PREFIXES = (f"{METRIC_TAG} ", f"{CHECKPOINT_TAG} ", f"{STOPPED_TAG} ")


def without_progress_lines(text: str) -> list[str]:
    """The log's lines as a person reads them: those a trainer or the SDK writes for the portal to parse left out."""
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


# The steps of a job's series, chosen among those recorded in the range [first, last], each read
# as the newest attempt's row. The range's first points + 1 steps are read (the (job, step,
# attempt) index, in order, stopping there): no more than `points`, and they are the answer whole.
# More, and the range is cut into at most points - 1 runs of `stride` steps, each giving its first
# recorded step (one index descent a run), and the last step is added: for a line every step these
# are the steps low, low + stride, ... and the last, as step arithmetic gives them. Every read is
# bounded by `points`, whatever the number of rows.
_SERIES = """
WITH probe AS (
    SELECT DISTINCT step FROM {table}
    WHERE job_id = %(job)s AND step >= %(first)s AND step <= %(last)s
    ORDER BY step LIMIT %(points)s + 1
), span AS (
    SELECT low, high, found, (high::bigint - low + greatest(%(points)s - 1, 1)) / greatest(%(points)s - 1, 1) AS stride
    FROM (SELECT (SELECT min(step) FROM probe) AS low, (SELECT count(*) FROM probe) AS found,
                 (SELECT max(step) FROM {table} WHERE job_id = %(job)s AND step >= %(first)s AND step <= %(last)s)
                 AS high) AS bounds
), chosen AS (
    SELECT step FROM probe WHERE (SELECT found FROM span) <= %(points)s
    UNION
    SELECT high FROM span
    UNION
    SELECT (SELECT min(step) FROM {table}
            WHERE job_id = %(job)s AND step >= run AND step < run + span.stride AND step <= span.high)
    FROM span CROSS JOIN LATERAL generate_series(span.low::bigint, span.high::bigint, span.stride) AS run
    WHERE span.found > %(points)s AND %(points)s > 1
)
SELECT m.step, m.attempt, m.loss, m.samples_per_s, m.at, span.low, span.high
FROM chosen CROSS JOIN span CROSS JOIN LATERAL (
    SELECT step, attempt, loss, samples_per_s, at FROM {table}
    WHERE job_id = %(job)s AND step = chosen.step ORDER BY attempt DESC LIMIT 1
) AS m
ORDER BY m.step
"""


def job_metric_series(job: Job, *, points: int = CHART_POINTS, first_step: int | None = None,
                      last_step: int | None = None) -> dict:
    """The job's loss curve as recorded: at most `points` of its recorded steps, spread evenly over the range.

    One record per step (the newest attempt's when a step was trained twice). The points are
    chosen among the steps recorded, not computed: a script's sparse lines (one a second and one
    per checkpoint) come back all while there are no more than `points` of them, and then as the
    first recorded in each of `points` - 1 equal runs of steps, with the last; the shipped
    trainer's line a step gets the same steps as ever. One query, whose cost depends on `points`,
    not on how many steps the job has run. With `points` 1 it is the newest step alone.
    """
    params = {"job": job.id, "first": 0 if first_step is None else first_step,
              "last": 2**31 - 1 if last_step is None else last_step, "points": max(1, points)}
    with connection.cursor() as cursor:
        cursor.execute(_SERIES.format(table=JobMetric._meta.db_table), params)
        rows = cursor.fetchall()
    if not rows:
        return {"series": [], "steps_recorded": 0, "first_step": None, "last_step": None}
    series = [
        {"attempt": attempt, "step": step, "loss": loss, "samples_per_s": samples_per_s, "time": at}
        for step, attempt, loss, samples_per_s, at, _, _ in rows
    ]
    low, high = rows[0][5], rows[0][6]
    return {"series": series, "steps_recorded": high - low + 1, "first_step": low, "last_step": high}


# --- A checkpoint's bytes -----------------------------------------------------------------


class CheckpointMissing(Exception):
    """The job has no such checkpoint to read: never recorded, or its file deleted (the API answers 404)."""


class CheckpointNotHere(Exception):
    """The backend keeps the checkpoint where the portal does not read it; the message says how to get it (409)."""


def checkpoint_missing_text(job: Job, step: int, why: str) -> str:
    kept = list(job.checkpoints.filter(deleted_at__isnull=True).order_by("step").values_list("step", flat=True))
    steps = f"its checkpoints kept are steps {', '.join(map(str, kept))}" if kept else "it keeps no checkpoint now"
    return f"Job {job.name} #{job.id} {why}; {steps}."


def job_checkpoint_open(job: Job, step: int) -> tuple[Checkpoint, CheckpointFile]:
    """The job's recorded checkpoint of `step`, opened through the backend; CheckpointMissing when it has none,
    its file was deleted (marked so, or found gone), CheckpointNotHere on a backend that does not read them,
    BackendUnavailable when the cluster cannot be read now."""
    checkpoint = job.checkpoints.filter(step=step).first() if 0 <= step < 2**31 else None
    if checkpoint is None:
        raise CheckpointMissing(checkpoint_missing_text(job, step, f"has no checkpoint of step {step}"))
    if checkpoint.deleted_at is not None:
        raise CheckpointMissing(checkpoint_missing_text(job, step, f"deleted its checkpoint of step {step}"))
    backend = get_backend()
    try:
        return checkpoint, backend.job_checkpoint(job.id, job.environment.namespace, checkpoint.uri)
    except CheckpointGone:
        raise CheckpointMissing(checkpoint_missing_text(job, step, f"deleted its checkpoint of step {step}")) from None
    except CheckpointElsewhere as exc:
        raise CheckpointNotHere(str(exc)) from None
    except BackendError as exc:
        raise BackendUnavailable(f"The {backend.name} backend cannot be read now: {exc}") from None


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


# --- Logs per replica, and how long a job ran and waited -----------------------------------

# The page shows this many of a replica's last lines; a download takes up to this many (the
# local backend reads the last 256 KiB of a log, the Kubernetes one asks the pod log API).
LOG_PAGE_LINES = 500
LOG_DOWNLOAD_LINES = 100_000
# Earlier attempts are offered in the log's picker only while the backend still has their log;
# asking costs a read each, so only this many of the newest are asked about.
LOG_EARLIER_ATTEMPTS = 5


def attempt_ranks(job: Job, attempt: JobAttempt) -> list[int]:
    """The replicas (ranks) an attempt was placed with."""
    return sorted({replica["replica"] for replica in attempt.placement}) or list(range(job.replicas))


def job_log_sources(job: Job, attempts: list[JobAttempt]) -> list[dict]:
    """The logs there are to read, newest attempt first: each started attempt with its ranks.

    The newest started attempt is always there; an earlier one only while the backend still
    answers rank 0's log (a Kubernetes attempt's pods go once it ends). A backend that cannot be
    read leaves the earlier ones out rather than failing the page.
    """
    started = [attempt for attempt in reversed(attempts) if attempt.started_at]
    if not started:
        return []
    sources = [{"attempt": started[0].number, "ranks": attempt_ranks(job, started[0]), "newest": True}]
    for attempt in started[1:LOG_EARLIER_ATTEMPTS + 1]:
        try:
            kept = bool(job_log_tail(job, attempt.number, 0, tail=1).strip())
        except BackendUnavailable:
            break
        if kept:
            sources.append({"attempt": attempt.number, "ranks": attempt_ranks(job, attempt), "newest": False})
    return sources


def job_log_lines(job: Job, attempt: int, rank: int, *, tail: int = LOG_PAGE_LINES) -> list[str]:
    """A replica's last lines as a person reads them (no progress lines), oldest first, newest last."""
    # Progress lines are most of a trainer's log: read more so `tail` readable ones are left.
    return without_progress_lines(job_log_tail(job, attempt, rank, tail=min(tail * 4, LOG_DOWNLOAD_LINES)))[-tail:]


def job_durations(job: Job, attempts: list[JobAttempt], now) -> dict:
    """How long the job has run and waited, from its attempt rows.

    `running_s`: the sum over its started attempts of each one's start to its end (to the job's
    end, or now while the job is not final, for one still open), so the waits between attempts are
    not counted as running; `queued_s`: from submit to the first admission, plus every wait between
    an attempt's end and the next one's admission (or to now, or to the end, when none followed).
    """
    final = job.state in JOB_FINAL_STATES
    end = (job.finished_at or job.state_changed_at or now) if final else now
    started = [attempt for attempt in attempts if attempt.started_at]
    running = sum(max(0.0, ((attempt.ended_at or end) - attempt.started_at).total_seconds()) for attempt in started)
    queued = 0.0
    waiting_since = job.submitted_at
    for attempt in attempts:
        if waiting_since is not None:
            queued += max(0.0, (attempt.admitted_at - waiting_since).total_seconds())
        waiting_since = attempt.ended_at
    # No attempt open: waiting since the last one ended (or since submit), up to now or to the end
    # (a job that ended with its last attempt adds nothing here).
    if waiting_since is not None:
        queued += max(0.0, (end - waiting_since).total_seconds())
    return {
        "final": final,
        "first_started_at": min((attempt.started_at for attempt in started), default=None),
        "running_s": running if started else None,
        "queued_s": queued,
    }
