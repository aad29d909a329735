"""The ledger under a random run: price cards for the past and the future, preemptions, cancels, resumes,
attempts that lost their end, and sweeps by two real workers at once, the money invariant checked after
every step.

USAGE_RANDOM_OPS (default 40) sets the run's length and USAGE_RANDOM_SEED its seed (a failure names
both); `USAGE_RANDOM_OPS=400` is the long form.
"""

import os
import random
from datetime import timedelta
from decimal import Decimal

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from common.dispatch import send_task
from common.errors import Invalid
from quotas.models import PriceCard
from quotas.services import price_set
from runners.jobs.models import Job, JobAttempt
from runners.usage import ledger
from runners.usage.models import Settlement, UsageEntry
from tests.support import invariants
from tests.support.jobs import demo_cluster_with_flavors, ready_environment
from tests.support.worker import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

OPS = int(os.environ.get("USAGE_RANDOM_OPS", "40"))
SEED = int(os.environ.get("USAGE_RANDOM_SEED", "4217"))


def test_the_ledger_matches_the_formula_through_a_random_run_with_two_sweeping_workers(
    celery_worker_factory, tenant, owner, staff
):
    rng = random.Random(SEED)
    flavors = demo_cluster_with_flavors()
    chosen = [flavors["h100-80gb"], flavors["t4-shared"]]
    environment = ready_environment(actor=owner, tenant=tenant)
    start = timezone.now()
    for flavor in chosen:
        PriceCard.objects.create(flavor=flavor, price_per_hour=Decimal("2.00"), effective_from=start - timedelta(days=30))
    workers = [celery_worker_factory(), celery_worker_factory()]
    counts = {"operations": 0, "price cards": len(chosen), "checks": 0, "sweeps": 0}
    done: list[str] = []

    def check():
        found = invariants.check_ledger()
        counts["checks"] += 1
        assert not found, (f"seed {SEED}, after {len(done)} operations (last: {done[-3:]}):\n"
                           + "\n".join(found[:10]) + "\n" + ledger_of(found))

    def ledger_of(found) -> str:
        """The attempts, settlements and entries of the jobs a violation names."""
        job_ids = {int(line.split()[1].split("/")[0]) for line in found}
        lines = []
        for attempt in JobAttempt.objects.filter(job_id__in=job_ids).order_by("job_id", "number"):
            settled = Settlement.objects.filter(kind="attempt", object_id=attempt.id).first()
            lines.append(f"{attempt.job_id}/{attempt.number} id {attempt.id}: {attempt.admitted_at} to "
                         f"{attempt.ended_at}, settled {settled and (settled.upto, settled.closed)}")
            for entry in UsageEntry.objects.filter(item=f"attempt:{attempt.id}").order_by("id"):
                lines.append(f"  {entry.piece} {entry.gpu_seconds} {entry.cost} at {entry.recorded_at}")
        return "\n".join(lines)

    def moment(earliest, latest):
        """A random moment in [earliest, latest], to the microsecond."""
        span = max(0, int((latest - earliest) / timedelta(microseconds=1)))
        return earliest + timedelta(microseconds=rng.randint(0, span))

    def last_attempts():
        return {job.id: job.attempts.order_by("-number").first() for job in Job.objects.filter(tenant=tenant)}

    def new_job():
        flavor = rng.choice(chosen)
        job = Job.objects.create(tenant=tenant, environment=environment, name=f"r{len(done)}",
                                 spec={"template": "pytorch-ddp"}, flavor=flavor, replicas=rng.randint(1, 2),
                                 gpus_per_replica=rng.randint(1, 2), state="running")
        attempt = JobAttempt.objects.create(job=job, number=1, placement=[])
        admitted = moment(start - timedelta(days=4), timezone.now())
        JobAttempt.objects.filter(id=attempt.id).update(admitted_at=admitted, started_at=admitted)
        return f"job {job.id}"

    def preempt():
        open_ones = [a for a in last_attempts().values() if a and a.ended_at is None]
        if not open_ones:
            return new_job()
        attempt = rng.choice(open_ones)
        # Its end as recorded: now, or learnt late (a moment already past, maybe days ago).
        ended = timezone.now() if rng.random() < 0.5 else moment(attempt.admitted_at, timezone.now())
        JobAttempt.objects.filter(id=attempt.id).update(ended_at=ended, outcome="preempted")
        send_task("runners.tasks.usage_settle", [attempt.job_id])
        return f"end {attempt.job_id}/{attempt.number}"

    def cancel():
        # A cancel ends every open attempt of its job at one moment (a lost end among them too).
        jobs_open = sorted({a.job_id for a in JobAttempt.objects.filter(job__tenant=tenant, ended_at__isnull=True)})
        if not jobs_open:
            return new_job()
        job_id = rng.choice(jobs_open)
        JobAttempt.objects.filter(job_id=job_id, ended_at__isnull=True).update(ended_at=timezone.now(),
                                                                               outcome="cancelled")
        send_task("runners.tasks.usage_settle", [job_id])
        return f"cancel {job_id}"

    def resume():
        latest = list(last_attempts().values())
        ended = [a for a in latest if a and a.ended_at is not None]
        # Now and then a job goes on while its attempt has no end recorded (a lost end).
        candidates = ended or [a for a in latest if a]
        if not candidates or (rng.random() < 0.25 and any(a.ended_at is None for a in latest if a)):
            candidates = [a for a in latest if a and a.ended_at is None] or candidates
        if not candidates:
            return new_job()
        previous = rng.choice(candidates)
        # Admitted after the previous one was, sometimes before it let go (the overlap is counted once).
        earliest = previous.admitted_at if previous.ended_at is None else max(
            previous.admitted_at, previous.ended_at - timedelta(minutes=30))
        admitted = moment(earliest, timezone.now())
        attempt = JobAttempt.objects.create(job_id=previous.job_id, number=previous.number + 1, placement=[])
        JobAttempt.objects.filter(id=attempt.id).update(admitted_at=admitted, started_at=admitted)
        return f"resume {previous.job_id}/{attempt.number}"

    def card():
        flavor = rng.choice(chosen)
        effective = moment(start - timedelta(days=4), timezone.now() + timedelta(days=1)).replace(microsecond=0)
        try:
            price_set(actor=staff, flavor=flavor, price_per_hour=Decimal(rng.randint(10, 500)) / 100,
                      currency="USD", effective_from=effective)
        except Invalid:
            return "card refused (one starts then already)"
        counts["price cards"] += 1
        return f"card {flavor.name} from {effective:%m-%d %H:%M}"

    def sweeps():
        # One for each worker: two sweeps at once.
        send_task("runners.tasks.usage_settle")
        send_task("runners.tasks.usage_settle")
        counts["sweeps"] += 2
        return "two sweeps"

    def sweep_here():
        ledger.settle_run()
        counts["sweeps"] += 1
        return "sweep here"

    operations = [(new_job, 3), (preempt, 3), (cancel, 1), (resume, 3), (card, 2), (sweeps, 3), (sweep_here, 1)]
    for _ in range(OPS):
        operation = rng.choices([op for op, _ in operations], weights=[w for _, w in operations])[0]
        done.append(operation())
        counts["operations"] += 1
        check()

    # Let the workers finish what they were sent, stop them, and sweep once more: every ended attempt
    # is then written in full, and a further sweep finds nothing to write.
    queue = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    wait_for(lambda: queue.llen(settings.CELERY_TASK_DEFAULT_QUEUE) == 0, timeout_s=120, message="the queue to drain")
    wait_for(lambda: all(w.output().count("] received") == w.output().count("] succeeded in ") for w in workers),
             timeout_s=120, message="the workers to finish their tasks")
    for worker in workers:
        worker.stop()
    check()
    day = timezone.now().date()
    ledger.settle_run()
    check()
    ended = {f"attempt:{a.id}" for a in JobAttempt.objects.filter(job__tenant=tenant, ended_at__isnull=False)}
    assert not [piece for piece in ledger.unwritten(timezone.now()) if piece.item in ended]
    if timezone.now().date() == day:  # (a sweep after midnight writes the day that just ended)
        assert ledger.settle_run()["entries"] == 0
    check()
    for worker in workers:
        assert "Traceback" not in worker.output(), worker.output()[-3000:]
    print(f"\nledger random run, seed {SEED}: {counts['operations']} operations, {counts['price cards']} price cards, "
          f"{counts['sweeps']} sweeps, {counts['checks']} checks, {JobAttempt.objects.count()} attempts, "
          f"none failed")
