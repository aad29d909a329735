"""Two beats at once (a rollout, or one started twice): every periodic task is sent twice, nothing is done twice.

Two `celery beat` processes and two workers run the job path for a while on a Redis of the
test's own, every period short: the scheduler cycle, the reconcile, the sweeps, the utilization
sampling and the ledger's settle (which downsamples the utilization samples that aged) all run
twice as often as asked, often at the same moment. Then: every job was admitted and started
once (one attempt, one start, one "admitted" event), the invariants hold, each attempt's GPU
time is in the ledger once (the sum of its entries is its units times its duration, no
correction), and the samples rolled up were counted once (the 5-minute row holds as many
readings as there were raw samples).

A second test drives the downsample race itself: one downsample's transaction left open beside a
second one. Before the second waited for the first (an advisory lock), it read the raw rows the
first was deleting, waited on the rows it had inserted, then added the same readings to them again.
"""

import threading
import time
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection, transaction
from django.db.models import Sum
from django.utils import timezone

from runners.clusters.registry import get_backend
from runners.jobs import services as jobs
from runners.jobs.models import Job, JobAttempt, JobEvent
from runners.usage import sampling
from runners.usage.models import Resolution, Settlement, UsageEntry, UtilizationSample
from tests.faults import support
from tests.support import invariants
from tests.support.jobs import give_quota, job_data, submit
from tests.support.worker import WorkerProcess, wait_for

pytestmark = pytest.mark.e2e

RAW_OLD = 6  # raw samples aged past retention, in one 5-minute bucket


def _old_samples(job, now) -> None:
    start = sampling._bucket_start(now - timedelta(days=2), timedelta(minutes=5))
    UtilizationSample.objects.bulk_create([
        UtilizationSample(tenant_id=job.tenant_id, job_id=job.id, attempt=1, rank=0, device="gpu-0",
                          at=start + timedelta(seconds=10 * index), resolution=Resolution.RAW, source="simulated",
                          gpu_util_pct=50.0, memory_used_mib=1000.0, power_w=300.0)
        for index in range(RAW_OLD)
    ])


def _rolled_up(job) -> list[tuple[str, int]]:
    return list(UtilizationSample.objects.filter(job=job).exclude(resolution=Resolution.RAW, at__gte=timezone.now()
                                                                  - timedelta(days=1))
                .values_list("resolution", "readings"))


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_two_beats_double_no_admission_launch_ledger_entry_or_sample(settings, tmp_path, tenant, owner):
    environment, base = support.quota_world(settings, tenant, owner)
    broker = support.PrivateRedis(tmp_path / "redis.log").start()
    trace = tmp_path / "trace.log"
    common = dict(
        CELERY_BROKER_URL=broker.url, CLUSTER_BACKEND_FACTORY=support.FACTORY, CHAOS_STEP_S=0.05, CHAOS_MAX_DELAY_MS=20,
        SCHEDULER_CYCLE_INTERVAL_S=1, JOB_RECONCILE_INTERVAL_S=1, JOB_LAUNCH_LEASE_S=3, JOB_LAUNCH_RESEND_AFTER_S=2,
        USAGE_SAMPLE_INTERVAL_S=1, USAGE_SETTLE_INTERVAL_S=2, SWEEP_INTERVAL_S=2, STUCK_AFTER_S=3,
        ENDPOINT_RECONCILE_INTERVAL_S=2, FAULTS_TRACE=trace,
    )

    def body(index):
        return job_data(environment, name=f"job-{index}", replicas=1, gpus_per_replica=1 + index % 2, steps=30,
                        checkpoint_every_steps=0, topology={"level": "none", "mode": "required"})

    seeded = jobs.job_submit(actor=owner, data=body(0))
    _old_samples(seeded, timezone.now())
    processes, workers = [], []
    try:
        for name in ("w1", "w2"):
            workers.append(WorkerProcess(tmp_path / f"{name}.log", PGAPPNAME=f"faults-{name}", **common).start())
        for name in ("beat1", "beat2"):
            processes.append(support.beat(tmp_path / f"{name}.log", PGAPPNAME=f"faults-{name}", **common))
        for process in processes:
            process.start()
        for process in processes:
            wait_for(lambda process=process: b"beat: Starting" in process.log_path.read_bytes(), timeout_s=30,
                     message="both beats to start")
        submitted = [seeded.id]
        for index in range(1, 12):
            submitted.append(jobs.job_submit(actor=owner, data=body(index)).id)
            time.sleep(0.7)
            problems = invariants.check(get_backend(), baseline=base, stuck_after_s=30)
            assert problems == [], problems
        wait_for(lambda: Job.objects.filter(id__in=submitted, state="succeeded").count() == len(submitted),
                 timeout_s=60, message="every job to succeed")
        attempts = list(JobAttempt.objects.filter(job_id__in=submitted).select_related("job"))
        wait_for(lambda: Settlement.objects.filter(kind="attempt", object_id__in=[a.id for a in attempts],
                                                   closed=True).count() == len(attempts),
                 timeout_s=30, message="every attempt settled")
        wait_for(lambda: not UtilizationSample.objects.filter(job=seeded, resolution=Resolution.RAW,
                                                             at__lt=timezone.now() - timedelta(days=1)).exists(),
                 timeout_s=30, message="the aged samples to be rolled up")
        assert any(b"usage_settle" in process.log_path.read_bytes() for process in processes)
        both_sent = [process.output().count("runners.tasks.scheduler_cycle") for process in processes]
        assert min(both_sent) >= 5, f"each beat sent its cycles: {both_sent}"
    finally:
        for process in processes:
            process.stop()
        for worker in workers:
            worker.stop()
        broker.kill()

    problems = invariants.check(get_backend(), baseline=base, stuck_after_s=30)
    assert problems == [], problems
    for job_id in submitted:
        assert list(JobAttempt.objects.filter(job_id=job_id).values_list("number", "outcome")) == [(1, "succeeded")], \
            invariants.describe([job_id])
        events = list(JobEvent.objects.filter(job_id=job_id).order_by("at", "id").values_list("to_state", flat=True))
        assert events == ["queued", "admitted", "launching", "running", "succeeded"], (job_id, events)
    created = sorted(int(line[3]) for line in support.trace_lines(trace) if line[2] == "launch" and line[5] == "created")
    assert created == sorted(submitted), "each job's replicas were started once"
    for attempt in attempts:
        entries = UsageEntry.objects.filter(item=f"attempt:{attempt.id}")
        assert not entries.filter(correction=True).exists(), f"attempt {attempt.id} needed a correction"
        counted = entries.aggregate(total=Sum("gpu_seconds"))["total"] or Decimal(0)
        truth = Decimal(str((attempt.ended_at - attempt.admitted_at).total_seconds())) * attempt.job.units
        assert abs(counted - truth) < Decimal("0.01"), (attempt.id, counted, truth)
    assert _rolled_up(seeded) == [(Resolution.FIVE_MINUTES, RAW_OLD)], "each aged reading was rolled up once"


@pytest.mark.django_db(transaction=True)
def test_a_second_downsample_beside_an_unfinished_one_counts_nothing_twice(tenant, owner, acme_env, flavors):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    job = submit(owner, acme_env, replicas=1, gpus_per_replica=1, topology={"level": "none", "mode": "required"})
    now = timezone.now()
    _old_samples(job, now)
    first_done, let_go, errors = threading.Event(), threading.Event(), []

    def first():
        try:
            with transaction.atomic():  # its work done, its transaction still open
                sampling.downsample_run(now=now)
                first_done.set()
                assert let_go.wait(30)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            first_done.set()
            connection.close()

    def second():
        try:
            sampling.downsample_run(now=now)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert first_done.wait(30)
    threads.append(threading.Thread(target=second))
    threads[1].start()
    time.sleep(0.5)  # the second is now waiting (on the lock; before the fix, on the first's rows)
    let_go.set()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert _rolled_up(job) == [(Resolution.FIVE_MINUTES, RAW_OLD)]
