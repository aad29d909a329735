"""Quota under load: many clients submitting at once, two workers running the cycle, checked from the attempts.

The suite runs a short form (8 clients x 10 jobs); the full run is a bench command:

    LOAD_CLIENTS=32 LOAD_JOBS_PER_CLIENT=50 make test PYTEST_ARGS="-s tests/jobs/test_job_load.py"

Jobs run on `tests.support.backends.QuickJobs` (timers in place of trainers), since what is under
test is admission and bookkeeping, not training. Mixed in: every client cancels some of its own
jobs as it goes (whatever state they are in by then), and a few environments are deleted mid-run
(each tenant submits into two; the second of some is deleted, cancelling its jobs, and submits
into it are refused from then on). From the recorded attempts: at no instant does a tenant hold
more than its max or the cluster more than its capacity; no job has two attempts at once; every
job ends in a final state (cancelled when its cancel was accepted or its environment deleted
before it finished, succeeded otherwise); no job of a deleted environment is admitted after the
delete, and every deleted environment is torn down.
"""

import os
import random
import threading
import time
from collections import Counter, defaultdict

import pytest
from django.db import connection

from runners.environments.models import Environment
from runners.jobs.models import JOB_FINAL_STATES, Job, JobAttempt
from tests.support.backends import use_backend
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment
from tests.support.worker import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

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
        tenants[slug] = (user, [ready_environment(actor=user, tenant=tenant),
                                ready_environment(actor=user, tenant=tenant, name="scratch")])
    # Two workers run the cycle (and everything else); the first also runs beat, as `manage.py up` runs one.
    periods = dict(SCHEDULER_CYCLE_INTERVAL_S=1, JOB_RECONCILE_INTERVAL_S=1)
    celery_worker_factory(beat=True, **periods)
    celery_worker_factory(**periods)

    submitted, refused, errors = [], [], []
    cancels = {"accepted": set(), "final_already": 0}
    # 503 answers (the database gave up on the request, say a deadlock) that a retry then got through.
    retried: list[str] = []

    def call(what, method, *args, **kwargs):
        """The request, retried on 503 as its Retry-After says (a submit carries an Idempotency-Key for it)."""
        for _ in range(5):
            response = method(*args, **kwargs)
            if response.status_code != 503:
                return response
            with lock:
                retried.append(what)
            time.sleep(0.2)
        return response
    lock = threading.Lock()
    total = CLIENTS * JOBS_PER_CLIENT
    # The "scratch" environments of two tenants go mid-run: one a third of the way, one two thirds.
    doomed = [(total // 3, "beta"), (2 * total // 3, "delta")]
    deleted: dict[int, str] = {}  # environment id -> tenant

    def delete_environments():
        try:
            for after, slug in doomed:
                while len(submitted) + len(refused) < after and not errors:
                    time.sleep(0.05)
                user, (_, scratch) = tenants[slug]
                response = call("environment delete", client_for(user).delete, f"/api/v1/environments/{scratch.id}/")
                assert response.status_code == 202, response.content
                with lock:
                    deleted[scratch.id] = slug
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    def client_run(index):
        rng = random.Random(index)
        slug = list(tenants)[index % len(tenants)]
        user, environments = tenants[slug]
        client = client_for(user)
        mine = []
        try:
            for number in range(JOBS_PER_CLIENT):
                replicas = rng.choice([1, 1, 2])
                gpus = rng.choice([g for g in (1, 2, 4) if replicas * g <= quotas[slug][1]])
                # Non-preemptible work runs only within the guarantee (bigger is refused at submit).
                preemptible = rng.random() < 0.8 or replicas * gpus > quotas[slug][0]
                environment = rng.choice(environments)
                response = call("submit", client.post, "/api/v1/jobs/", job_data(
                    environment, name=f"c{index}-j{number}", replicas=replicas, gpus_per_replica=gpus,
                    steps=rng.randint(10, 60), checkpoint_every_steps=0, preemptible=preemptible,
                    priority=rng.randint(0, 20), topology={"level": "none", "mode": "required"}, env={},
                ), format="json", HTTP_IDEMPOTENCY_KEY=f"c{index}-j{number}")
                with lock:
                    if response.status_code in (200, 201):
                        submitted.append((slug, response.json()["id"]))
                        mine.append(response.json()["id"])
                    else:
                        refused.append((slug, environment.id, response.status_code, response.content[:300]))
                # Now and then the client cancels one of its own jobs, in whatever state it is by now.
                if mine and rng.random() < 0.25:
                    victim = rng.choice(mine)
                    answer = call("cancel", client.post, f"/api/v1/jobs/{victim}/cancel/")
                    assert answer.status_code in (202, 409), answer.content
                    with lock:
                        if answer.status_code == 202:
                            cancels["accepted"].add(victim)
                        else:
                            cancels["final_already"] += 1
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    started = time.monotonic()
    threads = [threading.Thread(target=client_run, args=(index,)) for index in range(CLIENTS)]
    threads.append(threading.Thread(target=delete_environments))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(deleted) == len(doomed)
    # A submit is refused only for an environment deleted by then (400 naming it), or a tenant's full queue.
    for slug, environment_id, status, body in refused:
        assert (status == 400 and environment_id in deleted and b"environment" in body) or status == 429, (
            slug, environment_id, status, body)
    try:
        wait_for(lambda: Job.objects.exclude(state__in=JOB_FINAL_STATES).count() == 0, timeout_s=60 + total * 0.5,
                 interval_s=1, message="every job to end")
    except AssertionError as exc:
        left = Job.objects.exclude(state__in=JOB_FINAL_STATES)
        summary = sorted({(job.state, job.reason[:150]) for job in left})[:10]
        raise AssertionError(f"{exc} {left.count()} left: {summary}") from None
    elapsed = time.monotonic() - started
    wait_for(lambda: set(Environment.objects.filter(id__in=list(deleted), state="deleted").values_list("id", flat=True))
             == set(deleted), timeout_s=90, interval_s=1, message="every deleted environment to be torn down")

    jobs = {job.id: job for job in Job.objects.select_related("tenant", "environment")}
    assert len(jobs) == len(submitted) == len({job_id for _, job_id in submitted}), "no job lost, none made twice"
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
        deleted_at = job.environment.delete_requested_at
        assert deleted_at is None or attempt.admitted_at < deleted_at, (
            f"job {job.id} got attempt {attempt.number} after its environment was deleted")
    for spans in per_job.values():
        for (_, first_end), (second_start, _) in zip(spans, spans[1:]):
            assert second_start >= first_end, "a job never has two attempts at once"
    peaks, peak_total = _peaks(intervals)
    in_deleted = {job_id for job_id, job in jobs.items() if job.environment_id in deleted}
    print(
        f"\nload: {CLIENTS} clients x {JOBS_PER_CLIENT} jobs = {len(jobs)} submitted ({len(refused)} refused) in "
        f"{elapsed:.1f}s; states {dict(states)}; {len(cancels['accepted'])} cancels accepted, "
        f"{cancels['final_already']} too late; {len(deleted)} environments deleted with {len(in_deleted)} jobs "
        f"({sum(1 for j in in_deleted if jobs[j].state == 'cancelled' and j not in cancels['accepted'])} cancelled by "
        f"the delete); "
        f"{len(attempts)} attempts ({len(attempts) - len(per_job)} requeues); 503s retried {dict(Counter(retried))}; "
        f"peak held {peak_total}/{capacity}; "
        f"per tenant {peaks} against max { {slug: cap for slug, (_, cap) in quotas.items()} }"
    )
    assert peak_total <= capacity
    for slug, peak in peaks.items():
        assert peak <= quotas[slug][1], f"{slug} held {peak}, past its max {quotas[slug][1]}"
    for job_id, job in jobs.items():
        if job_id in cancels["accepted"]:
            assert job.state == "cancelled", f"job {job_id}: cancel accepted, but it {job.state}: {job.reason}"
        elif job_id in in_deleted:
            assert job.state in ("cancelled", "succeeded"), f"job {job_id} of a deleted environment: {job.state}"
        else:
            assert job.state == "succeeded", f"job {job_id}: {job.state}: {job.reason}"
    assert cancels["accepted"], "some cancels were accepted"
