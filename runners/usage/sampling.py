"""Utilization samples: read every open attempt's devices through the backend, store, downsample, find the idle.

The backend reads NVML (local, real GPUs), the DCGM exporter through Prometheus (Kubernetes) or
the workload's own measured activity (local, simulated GPUs); this module only attributes, keeps
and ages what it is handed. Raw samples are averaged into 5-minute buckets after
USAGE_RAW_RETENTION_DAYS, those into hours after USAGE_5M_RETENTION_DAYS, and hourly ones dropped
after USAGE_RETENTION_DAYS, in SQL, so the table stays small whatever the cluster's size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Avg, Count, Max
from django.utils import timezone

from runners.backends.base import BackendError
from runners.clusters.registry import get_backend
from runners.inference.models import Replica
from runners.jobs.models import Job, JobAttempt
from runners.usage.models import Resolution, Source, UtilizationSample

logger = logging.getLogger(__name__)

# The downsample's transaction-level advisory lock key: "usgdwn" in ASCII.
DOWNSAMPLE_LOCK_KEY = 0x75736764776E


def sample_run(now: datetime | None = None) -> dict:
    """One reading of every open, started attempt's devices; returns how many samples were stored."""
    attempts = {
        (attempt.job_id, attempt.number): attempt
        for attempt in JobAttempt.objects.open().filter(started_at__isnull=False).select_related("job")
    }
    if not attempts:
        return {"attempts": 0, "samples": 0}
    try:
        readings = get_backend().gpu_readings(set(attempts))
    except BackendError as exc:
        logger.warning("Utilization readings failed this time: %s", exc)
        return {"attempts": len(attempts), "samples": 0, "error": str(exc)}
    return {"attempts": len(attempts), "samples": store(readings, attempts, now=now)}


def store(readings: dict, attempts: dict[tuple[int, int], JobAttempt], *, now: datetime | None = None) -> int:
    """Keep the readings of the attempts asked about (anything else a backend returns is dropped)."""
    now = now or timezone.now()
    rows = []
    for key, device_readings in readings.items():
        attempt = attempts.get(key)
        if attempt is None:
            continue
        for reading in device_readings:
            at = datetime.fromtimestamp(reading.at, UTC) if reading.at else now
            rows.append(UtilizationSample(
                tenant_id=attempt.job.tenant_id, job_id=attempt.job_id, attempt=attempt.number, rank=reading.rank,
                device=reading.device[:200], at=at, resolution=Resolution.RAW, source=reading.source,
                gpu_util_pct=reading.gpu_util_pct, memory_used_mib=reading.memory_used_mib, power_w=reading.power_w,
            ))
    # The same reading read twice (a backend's value that has not moved since the last pass) is kept once.
    UtilizationSample.objects.bulk_create(rows, batch_size=2000, ignore_conflicts=True)
    return len(rows)


_ROLL_UP = """
INSERT INTO usage_utilizationsample
    (tenant_id, job_id, attempt, rank, device, at, resolution, source, gpu_util_pct, memory_used_mib, power_w, readings)
SELECT tenant_id, job_id, attempt, rank, device, date_bin(%(bucket)s::interval, at, TIMESTAMPTZ '2000-01-01'),
       %(to)s, max(source), avg(gpu_util_pct), avg(memory_used_mib), avg(power_w), sum(readings)
FROM usage_utilizationsample
WHERE resolution = %(from)s AND at < %(cutoff)s
GROUP BY tenant_id, job_id, attempt, rank, device, date_bin(%(bucket)s::interval, at, TIMESTAMPTZ '2000-01-01')
ON CONFLICT (job_id, attempt, rank, device, resolution, at) DO UPDATE SET
    gpu_util_pct = (coalesce(usage_utilizationsample.gpu_util_pct * usage_utilizationsample.readings, 0)
                    + coalesce(EXCLUDED.gpu_util_pct * EXCLUDED.readings, 0))
                   / (usage_utilizationsample.readings + EXCLUDED.readings),
    memory_used_mib = (coalesce(usage_utilizationsample.memory_used_mib * usage_utilizationsample.readings, 0)
                       + coalesce(EXCLUDED.memory_used_mib * EXCLUDED.readings, 0))
                      / (usage_utilizationsample.readings + EXCLUDED.readings),
    power_w = (coalesce(usage_utilizationsample.power_w * usage_utilizationsample.readings, 0)
               + coalesce(EXCLUDED.power_w * EXCLUDED.readings, 0))
              / (usage_utilizationsample.readings + EXCLUDED.readings),
    readings = usage_utilizationsample.readings + EXCLUDED.readings
"""


def _bucket_start(moment: datetime, bucket: timedelta) -> datetime:
    epoch = datetime(2000, 1, 1, tzinfo=UTC)
    return epoch + (moment - epoch) // bucket * bucket


def downsample_run(now: datetime | None = None) -> dict:
    """Average what has aged into the next resolution and delete what is past retention; returns rows removed."""
    now = now or timezone.now()
    removed = {}
    steps = [
        (Resolution.RAW, Resolution.FIVE_MINUTES, timedelta(minutes=5), settings.USAGE_RAW_RETENTION_DAYS),
        (Resolution.FIVE_MINUTES, Resolution.HOUR, timedelta(hours=1), settings.USAGE_5M_RETENTION_DAYS),
    ]
    for source, target, bucket, keep_days in steps:
        # Whole buckets only, so a bucket is never averaged from half its readings.
        cutoff = _bucket_start(now - timedelta(days=keep_days), bucket)
        with transaction.atomic():
            with connection.cursor() as cursor:
                # One roll-up at a time (two beats send two settles at once): a second one started
                # beside the first would read the raw rows the first is deleting, wait on the rows it
                # inserted, then add the same readings to them again. Waiting here, its statements
                # start after the first has committed and find nothing left to roll up.
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [DOWNSAMPLE_LOCK_KEY])
                cursor.execute(_ROLL_UP, {"bucket": f"{int(bucket.total_seconds())} seconds", "to": target,
                                          "from": source, "cutoff": cutoff})
            removed[source] = UtilizationSample.objects.filter(resolution=source, at__lt=cutoff).delete()[0]
    removed[Resolution.HOUR] = UtilizationSample.objects.filter(
        resolution=Resolution.HOUR, at__lt=now - timedelta(days=settings.USAGE_RETENTION_DAYS)
    ).delete()[0]
    return removed


# --- Series and idle allocations -------------------------------------------------------------


def series(job_ids: list[int], start: datetime, end: datetime) -> list[dict]:
    """Per job, attempt, rank and device: the points in [start, end), whatever their resolution."""
    rows = (
        UtilizationSample.objects.filter(job_id__in=job_ids, at__gte=start, at__lt=end)
        .order_by("job_id", "attempt", "rank", "device", "at")
        .values_list("job_id", "attempt", "rank", "device", "source", "resolution", "at", "gpu_util_pct",
                     "memory_used_mib", "power_w")
    )
    out: dict[tuple, dict] = {}
    for job_id, attempt, rank, device, source, resolution, at, util, memory, power in rows:
        entry = out.setdefault((job_id, attempt, rank, device), {
            "job": job_id, "attempt": attempt, "rank": rank, "device": device, "source": source,
            "simulated": source == Source.SIMULATED, "points": [],
        })
        entry["points"].append({"at": at.isoformat(), "resolution": resolution, "gpu_util_pct": util,
                                "memory_used_mib": memory, "power_w": power})
    return list(out.values())


@dataclass(frozen=True)
class IdleAllocation:
    job: Job
    endpoint_id: int | None
    attempt: int
    units: int
    average_util_pct: float | None  # None: no reading in the window (the workload stopped reporting)
    peak_util_pct: float | None
    samples: int
    simulated: bool


def idle_allocations(*, tenant_ids: set[int] | None = None, threshold_pct: float | None = None,
                     window_s: float | None = None, now: datetime | None = None) -> list[IdleAllocation]:
    """Open attempts that held their GPUs for the whole window with every device's utilization under the threshold.

    Judged on the window's samples only: an attempt started within the window, or whose devices
    report no utilization (a MIG instance read through NVML), is never flagged. The peak decides,
    so an attempt busy at any moment of the window is not idle. An attempt that gave no reading in
    the whole window is idle: a workload that stopped reporting (a hung trainer holding its GPU)
    is exactly what this is for.
    """
    now = now or timezone.now()
    threshold = settings.USAGE_IDLE_THRESHOLD_PCT if threshold_pct is None else threshold_pct
    since = now - timedelta(seconds=settings.USAGE_IDLE_WINDOW_S if window_s is None else window_s)
    attempts = JobAttempt.objects.open().filter(started_at__lte=since).select_related("job", "job__flavor", "job__tenant")
    if tenant_ids is not None:
        attempts = attempts.filter(job__tenant_id__in=tenant_ids)
    attempts = {(attempt.job_id, attempt.number): attempt for attempt in attempts}
    if not attempts:
        return []
    figures = {
        (row["job_id"], row["attempt"]): row
        for row in UtilizationSample.objects.filter(job_id__in={job_id for job_id, _ in attempts}, at__gte=since,
                                                    at__lte=now)
        .values("job_id", "attempt")
        .annotate(average=Avg("gpu_util_pct"), peak=Max("gpu_util_pct"), samples=Count("gpu_util_pct"),
                  readings=Count("id"), simulated=Max("source"))
        .order_by()
    }
    endpoints = dict(Replica.objects.filter(job_id__in={job_id for job_id, _ in attempts})
                     .values_list("job_id", "endpoint_id"))
    idle = []
    for key, attempt in attempts.items():
        row = figures.get(key)
        if row is not None and (not row["samples"] or row["peak"] >= threshold):
            continue  # read, but busy at some moment, or with no utilization to judge by
        idle.append(IdleAllocation(
            job=attempt.job, endpoint_id=endpoints.get(attempt.job_id), attempt=attempt.number,
            units=attempt.job.units, average_util_pct=row["average"] if row else None,
            peak_util_pct=row["peak"] if row else None, samples=row["samples"] if row else 0,
            simulated=bool(row) and row["simulated"] == Source.SIMULATED,
        ))
    return sorted(idle, key=lambda item: (-item.units, item.job.id))
