"""Quota under load: many clients submitting at once, two workers running the cycle, checked from the attempts.

The suite runs a short form (8 clients x 10 jobs); the full run is a bench command:

    LOAD_CLIENTS=32 LOAD_JOBS_PER_CLIENT=50 make test PYTEST_ARGS="-s tests/runners/test_job_load.py"

Jobs run on `tests.support.backends.QuickJobs` (timers in place of trainers), since what is under
test is admission and bookkeeping, not training. From the recorded attempts: at no instant does a
tenant hold more than its max or the cluster more than its capacity; no job has two attempts at
once; every job ends in a final state.
"""

import os
import random
import threading
import time
from collections import defaultdict

import pytest
from django.db import connection

from runners.models import JOB_FINAL_STATES, Job, JobAttempt
from tests.support.backends import use_backend
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment
from tests.support.worker import wait_for

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]

CLIENTS = int(os.environ.get("LOAD_CLIENTS", "8"))
JOBS_PER_CLIENT = int(os.environ.get("LOAD_JOBS_PER_CLIENT", "10"))


def _peaks(intervals: list[tuple[float, float, str, int]]) -> tuple[dict[str, int], int]:
    """Highest units held at any instant, per tenant and in all, from (start, end, tenant, units)."""
    events = []
    for start, end, tenant, units in intervals:
        events.append((start, 1, tenant, units))
        events.append((end, 0, tenant, -units))  # at equal times, releases first
    held, total, peaks, peak_total = defaultdict(int), 0, defaultdict(int), 0
    for _, _, tenant, delta in sorted(events):
        held[tenant] += delta
        total += delta
        peaks[tenant] = max(peaks[tenant], held[tenant])
        peak_total = max(peak_total, total)
    return dict(peaks), peak_total


def test_concurrent_submissions_never_pass_max_or_capacity_and_every_job_ends(
    settings, celery_worker_factory, client_for, make_user
):
    from tenants.models import Membership, Tenant

    use_backend(settings, "quick_jobs")
    flavors = demo_cluster_with_flavors()
    h100 = flavors["h100-80gb"]
    capacity = h100.capacity
    quotas = {"alpha": (4, 12), "beta": (4, 8), "gamma": (8, 16), "delta": (0, 6)}
    tenants = {}
    for slug, (guaranteed, cap) in quotas.items():
        tenant = Tenant.objects.create(slug=slug, name=slug.title())
        user = make_user(f"{slug}-owner")
        Membership.objects.create(tenant=tenant, user=user, role="owner")
        give_quota(tenant, h100, guaranteed=guaranteed, max=cap)
        tenants[slug] = (user, ready_environment(actor=user, tenant=tenant))
    for _ in range(2):
        celery_worker_factory(SCHEDULER_CYCLE_INTERVAL_S=1, JOB_RECONCILE_INTERVAL_S=1)
    celery_worker_factory(beat=True, SCHEDULER_CYCLE_INTERVAL_S=1, JOB_RECONCILE_INTERVAL_S=1)

    submitted, refused, errors = [], [], []
    lock = threading.Lock()

    def client_run(index):
        rng = random.Random(index)
        slug = list(tenants)[index % len(tenants)]
        user, environment = tenants[slug]
        client = client_for(user)
        try:
            for number in range(JOBS_PER_CLIENT):
                replicas = rng.choice([1, 1, 2])
                gpus = rng.choice([g for g in (1, 2, 4) if replicas * g <= quotas[slug][1]])
                # Non-preemptible work runs only within the guarantee (bigger is refused at submit).
                preemptible = rng.random() < 0.8 or replicas * gpus > quotas[slug][0]
                response = client.post("/api/v1/jobs/", job_data(
                    environment, name=f"c{index}-j{number}", replicas=replicas, gpus_per_replica=gpus,
                    steps=rng.randint(10, 60), checkpoint_every_steps=0, preemptible=preemptible,
                    priority=rng.randint(0, 20), topology={"level": "none", "mode": "required"}, env={},
                ), format="json")
                with lock:
                    (submitted if response.status_code == 201 else refused).append((slug, response.status_code))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    started = time.monotonic()
    threads = [threading.Thread(target=client_run, args=(index,)) for index in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert not refused, refused[:5]
    total = CLIENTS * JOBS_PER_CLIENT
    try:
        wait_for(lambda: Job.objects.exclude(state__in=JOB_FINAL_STATES).count() == 0, timeout_s=60 + total * 0.5,
                 interval_s=1, message="every job to end")
    except AssertionError as exc:
        left = Job.objects.exclude(state__in=JOB_FINAL_STATES)
        summary = sorted({(job.state, job.reason[:150]) for job in left})[:10]
        raise AssertionError(f"{exc} {left.count()} left: {summary}") from None
    elapsed = time.monotonic() - started

    jobs = {job.id: job for job in Job.objects.select_related("tenant")}
    assert len(jobs) == total, "no job lost, none made twice"
    states = defaultdict(int)
    for job in jobs.values():
        states[job.state] += 1
    attempts = list(JobAttempt.objects.filter(job__in=list(jobs)).order_by("job_id", "number"))
    intervals, per_job = [], defaultdict(list)
    for attempt in attempts:
        job = jobs[attempt.job_id]
        start, end = attempt.admitted_at.timestamp(), (attempt.ended_at or attempt.admitted_at).timestamp()
        intervals.append((start, end, job.tenant.slug, job.units))
        per_job[job.id].append((start, end))
    for spans in per_job.values():
        for (_, first_end), (second_start, _) in zip(spans, spans[1:]):
            assert second_start >= first_end, "a job never has two attempts at once"
    peaks, peak_total = _peaks(intervals)
    print(
        f"\nload: {CLIENTS} clients x {JOBS_PER_CLIENT} jobs = {total} in {elapsed:.1f}s; states {dict(states)}; "
        f"{len(attempts)} attempts ({len(attempts) - total} requeues); peak held {peak_total}/{capacity}; "
        f"per tenant {peaks} against max { {slug: cap for slug, (_, cap) in quotas.items()} }"
    )
    assert peak_total <= capacity
    for slug, peak in peaks.items():
        assert peak <= quotas[slug][1], f"{slug} held {peak}, past its max {quotas[slug][1]}"
    assert states["succeeded"] == total, dict(states)
