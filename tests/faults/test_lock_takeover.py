"""The worker holding the scheduling cycle's lock, or the reconcile's, is SIGKILLed: another takes over.

Two real workers and a separate beat, on a Redis of the test's own (the test process's own kicks
go elsewhere, so only the beat's periodic cycles run). Holding the cycle: the test locks the one
SchedulerCycle row from a connection of its own; the next cycle takes the advisory lock, then waits
on that row. The holder is found in pg_locks (its connection's application_name names the worker,
set with PGAPPNAME), and the other worker's cycles are seen to skip, never to wait in line. The
holder is SIGKILLed, the row let go: its transaction dies with its connection, and a cycle on the
other worker commits within two periods. Holding the reconcile: the test backend's ``jobs_open``
(called once per pass, with the lock held) waits while a file exists; the holder is killed, the
file removed, and the other worker's pass runs within two periods.

Throughout: no job is admitted twice (one attempt each, never two open), no GPU is held twice and
no quota or capacity is exceeded (tests.support.invariants), and every job ends succeeded.
"""

import time

import pytest
from django.db import connection

from runners.clusters.registry import get_backend
from runners.jobs import services as jobs
from runners.jobs.models import Job, JobAttempt
from runners.jobs.reconcile import RECONCILE_LOCK_KEY
from runners.scheduling.models import SchedulerCycle
from runners.scheduling.services import CYCLE_LOCK_KEY
from tests.faults import support
from tests.support import invariants
from tests.support.jobs import job_data
from tests.support.worker import WorkerProcess, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

PERIOD_S = 1


def _submit(owner, environment, count, prefix):
    return [
        jobs.job_submit(actor=owner, data=job_data(
            environment, name=f"{prefix}-{index}", replicas=1, gpus_per_replica=2, steps=30, checkpoint_every_steps=0,
            topology={"level": "none", "mode": "required"},
        )).id
        for index in range(count)
    ]


def _holder(key: int) -> tuple[int, str]:
    granted = [(pid, name) for pid, name, held in support.advisory_holders(key) if held]
    return granted[0] if granted else None


def _cycle_runs() -> int:
    return SchedulerCycle.objects.filter(id=1).values_list("runs", flat=True).first() or 0


def test_the_cycle_and_the_reconcile_move_to_another_worker_when_their_holder_dies(
    settings, tmp_path, tenant, owner, record_property
):
    environment, base = support.quota_world(settings, tenant, owner)
    broker = support.PrivateRedis(tmp_path / "redis.log").start()
    trace, hold = tmp_path / "trace.log", tmp_path / "hold-reconcile"
    common = dict(
        CELERY_BROKER_URL=broker.url, CLUSTER_BACKEND_FACTORY=support.FACTORY, CHAOS_STEP_S=0.05,
        SCHEDULER_CYCLE_INTERVAL_S=PERIOD_S, JOB_RECONCILE_INTERVAL_S=PERIOD_S, JOB_LAUNCH_LEASE_S=3,
        JOB_LAUNCH_RESEND_AFTER_S=2, ENDPOINT_RECONCILE_INTERVAL_S=30, USAGE_SAMPLE_INTERVAL_S=30,
        FAULTS_TRACE=trace, FAULTS_HOLD=hold,
    )
    workers = {}

    def start_worker(name):
        workers[name] = WorkerProcess(tmp_path / f"{name}.log", PGAPPNAME=f"faults-{name}", **common).start()

    the_beat = support.beat(tmp_path / "beat.log", PGAPPNAME="faults-beat", **common)
    lock_holder = support.raw_connection()
    try:
        start_worker("w1")
        start_worker("w2")
        the_beat.start(ready=b"beat: Starting")

        # --- The cycle -----------------------------------------------------------------------
        SchedulerCycle.objects.get_or_create(id=1)
        lock_holder.execute("SELECT id FROM runners_schedulercycle WHERE id = 1 FOR UPDATE")
        runs_before = _cycle_runs()
        first = _submit(owner, environment, 4, "first")
        holder = wait_for(lambda: _holder(CYCLE_LOCK_KEY), timeout_s=20, interval_s=0.05,
                          message="a cycle to take the lock and wait on the held row")
        name = holder[1].removeprefix("faults-")
        assert name in workers, f"the cycle lock is held by {holder}, not a worker"
        other = next(worker for worker in workers if worker != name)
        # The other worker keeps receiving the beat's cycles: each one skips, none waits in line.
        deadline = time.monotonic() + 3 * PERIOD_S
        while time.monotonic() < deadline:
            waiting = [row for row in support.advisory_holders(CYCLE_LOCK_KEY) if not row[2]]
            assert not waiting, f"a cycle waits for the lock instead of skipping: {waiting}"
            time.sleep(0.1)
        assert "Scheduler cycle skipped: another cycle holds the lock" in workers[other].output()
        assert Job.objects.filter(id__in=first, state="queued").count() == 4, "nothing committed while it was held"

        workers.pop(name).kill()
        lock_holder.rollback()
        released = time.monotonic()
        wait_for(lambda: _cycle_runs() > runs_before, timeout_s=30, interval_s=0.05,
                 message="a cycle to commit after the holder died")
        cycle_takeover_s = time.monotonic() - released
        record_property("cycle_takeover_s", round(cycle_takeover_s, 2))
        assert not [row for row in support.advisory_holders(CYCLE_LOCK_KEY) if row[1] == holder[1]]
        wait_for(lambda: not Job.objects.filter(id__in=first, state="queued").exists(), timeout_s=30,
                 message="the first jobs to be admitted")

        # --- The reconcile -------------------------------------------------------------------
        start_worker("w3")
        second = _submit(owner, environment, 2, "second")
        hold.touch()
        held_at = time.time()
        # A pass traced after the file was made waits in jobs_open, the lock held, until it goes.
        wait_for(lambda: any(float(line[0]) > held_at and line[2] == "pass" for line in support.trace_lines(trace)),
                 timeout_s=10, interval_s=0.05, message="a reconcile pass to be held in jobs_open")
        holder = wait_for(lambda: _holder(RECONCILE_LOCK_KEY), timeout_s=5, interval_s=0.05,
                          message="the held pass's lock in pg_locks")
        name = holder[1].removeprefix("faults-")
        assert name in workers, f"the reconcile lock is held by {holder}, not a worker"
        time.sleep(2 * PERIOD_S)
        # The session-level lock is tried, never waited for: nobody queues behind the holder.
        assert [row for row in support.advisory_holders(RECONCILE_LOCK_KEY) if row[2]] == [holder + (True,)]
        assert not [row for row in support.advisory_holders(RECONCILE_LOCK_KEY) if not row[2]]

        workers.pop(name).kill()
        hold.unlink()
        released, released_at = time.monotonic(), time.time()
        wait_for(lambda: any(float(line[0]) >= released_at and line[2] == "pass"
                             for line in support.trace_lines(trace)),
                 timeout_s=30, interval_s=0.05, message="another worker's reconcile pass after the holder died")
        reconcile_takeover_s = time.monotonic() - released
        record_property("reconcile_takeover_s", round(reconcile_takeover_s, 2))
        print(f"\ntakeover after the holder's death: cycle {cycle_takeover_s:.2f}s, reconcile {reconcile_takeover_s:.2f}s "
              f"(period {PERIOD_S}s)")

        everything = first + second
        wait_for(lambda: Job.objects.filter(id__in=everything, state="succeeded").count() == len(everything),
                 timeout_s=60, message="every job to succeed")
        problems = invariants.check(get_backend(), baseline=base, stuck_after_s=60)
        assert problems == [], problems
        for job_id in everything:
            attempts = list(JobAttempt.objects.filter(job_id=job_id).values_list("number", "outcome"))
            assert attempts == [(1, "succeeded")], (job_id, attempts, invariants.describe([job_id]))
        launches = [line for line in support.trace_lines(trace) if line[2] == "launch" and line[5] == "created"]
        assert sorted(int(line[3]) for line in launches) == sorted(everything), "each job started exactly once"
        assert cycle_takeover_s <= 2 * PERIOD_S + 1, f"the cycle took {cycle_takeover_s:.1f}s to move on"
        assert reconcile_takeover_s <= 2 * PERIOD_S + 1, f"the reconcile took {reconcile_takeover_s:.1f}s to move on"
    finally:
        hold.unlink(missing_ok=True)
        lock_holder.close()
        the_beat.stop()
        for worker in workers.values():
            worker.stop()
        broker.kill()
        connection.close()
