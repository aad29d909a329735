"""Races on the job path, each forced into one interleaving and checked against the ownership rule.

Every test holds one side at a chosen moment, either inside a backend call (the Gated backend of
tests/support/backends.py) or inside the database (a row locked from another connection, the other
side seen waiting on it in pg_stat_activity), lets the other side act, then lets the first go on.
Each docstring says what the code before the fix did in that interleaving.

What every test checks in the end is the rule of runners/jobs/attempts.py: a job that holds GPUs by its
state has exactly one open attempt, nothing else has one, and nothing runs on the cluster for an
attempt that has ended (the local backend's own view: its supervisor processes).
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
from django.conf import settings as django_settings
from django.db import connection, connections, transaction
from django.utils import timezone

from runners.backends.base import PermanentBackendError, TransientBackendError
from runners.backends.local import LocalBackend
from runners.clusters import services as clusters
from runners.clusters.models import Node, NodePool, PartitionChange, PartitionProfile
from runners.clusters.registry import local_backend_options
from runners.environments import services as environments
from runners.environments.models import Environment
from runners.jobs import attempts, reconcile
from runners.jobs import services as jobs
from runners.jobs.models import JOB_HOLDING_STATES, IdempotencyKey, Job, JobAttempt, JobState
from runners.scheduling import services as scheduling
from tenants.models import Tenant
from tests.support.backends import Gate, Gated, use_backend
from tests.support.jobs import give_quota, job_data, ready_environment, submit
from tests.support.partitions import drive_partition_change
from tests.support.races import InThread, lock_waiters, rows_locked, wait_until

pytestmark = pytest.mark.e2e

ONE_GPU = {"replicas": 1, "gpus_per_replica": 1, "topology": {"level": "none", "mode": "preferred"}}
# A trainer that keeps running until it is stopped (the conftest kills what a test leaves).
LONG = {"steps": 1_000_000, "checkpoint_every_steps": 0, "max_runtime_s": 3600}


# --- Fixtures -------------------------------------------------------------------------------


@pytest.fixture
def acme_env(flavors, tenant, owner):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16)
    return ready_environment(actor=owner, tenant=tenant)


@pytest.fixture
def gates(settings):
    """The Gated backend; ``gates(name)`` holds that call until the test opens the gate it returns."""
    use_backend(settings, "gated")
    Gated.gates.clear()
    made: list[Gate] = []

    def gate(name: str) -> Gate:
        made.append(Gate())
        Gated.gates[name] = made[-1]
        return made[-1]

    yield gate
    for held in made:  # never leave a thread waiting on a gate past the test
        held.opened.set()
    Gated.gates.clear()


class Scripted(Gated):
    """Gated, and the status read of the jobs named in ``broken`` (job id: error) raises."""

    broken: dict = {}

    def job_status(self, job_id, attempt):
        error = Scripted.broken.get(job_id)
        if error is not None:
            raise error
        return super().job_status(job_id, attempt)


def scripted_backend() -> Scripted:
    return Scripted(**local_backend_options())


@pytest.fixture
def scripted(settings):
    """The Scripted backend (CLUSTER_BACKEND_FACTORY names this module's factory)."""
    from runners.clusters.registry import get_backend

    settings.CLUSTER_BACKEND_FACTORY = f"{__name__}.scripted_backend"
    get_backend.cache_clear()
    Scripted.broken.clear()
    Gated.gates.clear()
    yield Scripted.broken
    for gate in Gated.gates.values():
        gate.opened.set()
    Gated.gates.clear()
    Scripted.broken.clear()


# --- Helpers --------------------------------------------------------------------------------


def _cluster() -> LocalBackend:
    """The plain local backend over the test's folders: what runs, seen from outside the portal."""
    return LocalBackend(**local_backend_options())


def _phase(job_id: int, attempt: int) -> str:
    return _cluster().job_status(job_id, attempt).phase


def _assert_attempts_match_states() -> None:
    """A job holding GPUs by its state has exactly one open attempt; any other job has none."""
    for job in Job.objects.all():
        open_count = job.attempts.filter(ended_at__isnull=True).count()
        expected = 1 if job.state in JOB_HOLDING_STATES else 0
        assert open_count == expected, f"job {job.id} is {job.state} with {open_count} open attempt(s)"
        if job.state == JobState.RUNNING:
            assert job.attempts.get(ended_at__isnull=True).started_at is not None


def _assert_nothing_runs_for_ended_attempts() -> None:
    for attempt in JobAttempt.objects.filter(ended_at__isnull=False):
        assert _phase(attempt.job_id, attempt.number) != "running", (
            f"job {attempt.job_id} attempt {attempt.number} ended ({attempt.outcome}) but runs on the cluster"
        )




def _admitted(actor, environment, **overrides) -> Job:
    job = submit(actor, environment, **{**ONE_GPU, **overrides})
    scheduling.cycle_run()
    job.refresh_from_db()
    assert job.state == JobState.ADMITTED, job.reason
    return job


def _started_without_processes(job: Job) -> JobAttempt:
    """Play a launcher that recorded the start: running, its attempt started, nothing on the cluster."""
    job.refresh_from_db()
    assert jobs.transition(job, JobState.LAUNCHING, "test: claimed")
    attempt = job.attempts.get(ended_at__isnull=True)
    JobAttempt.objects.filter(id=attempt.id).update(started_at=timezone.now())
    assert jobs.transition(job, JobState.RUNNING, "test: started")
    attempt.refresh_from_db()
    return attempt


def _reconcile_until(predicate, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reconcile.jobs_reconcile_run()
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError("the reconcile did not get there in time")


def _ended(attempt: JobAttempt) -> bool:
    attempt.refresh_from_db()
    return attempt.ended_at is not None


def _sent_job_launches() -> list[str]:
    """The argsrepr of every job_launch message waiting in this run's queue on the broker."""
    import redis

    client = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
    queue = django_settings.CELERY_TASK_DEFAULT_QUEUE
    found = []
    for key in client.keys(f"{queue}*"):
        if client.type(key) != b"list":
            continue
        for raw in client.lrange(key, 0, -1):
            headers = json.loads(raw).get("headers") or {}
            if headers.get("task") == "runners.tasks.job_launch":
                found.append(headers.get("argsrepr", ""))
    return found


# --- 1. A victim preempted while admitted, and its launch ---------------------------------------


def _borrower_and_owed(tenant, other_tenant, owner, outsider, acme_env, globex_env, flavors) -> tuple[Job, Job]:
    """acme borrows all 16 H100s with an admitted (not launched) job; globex's guaranteed job then needs 8."""
    give_quota(tenant, flavors["h100-80gb"], guaranteed=0, max=16)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    # LONG: a borrower that runs is still running when its stop comes, however loaded the machine.
    borrower = submit(owner, acme_env, name="borrower", replicas=2, gpus_per_replica=8,
                       topology={"level": "none", "mode": "preferred"}, **LONG)
    scheduling.cycle_run()
    borrower.refresh_from_db()
    assert borrower.state == JobState.ADMITTED, borrower.reason
    owed = submit(outsider, globex_env, name="owed", replicas=1, gpus_per_replica=8, priority=50)
    return borrower, owed


@pytest.mark.django_db(transaction=True)
def test_a_victim_preempted_while_admitted_is_not_launched_by_the_launch_that_comes_next(
    tenant, other_tenant, owner, outsider, acme_env, globex_env, flavors, gates
):
    """The cycle ends the admitted victim's attempt; the launch, arriving meanwhile, must then start nothing.

    Forced order: the cycle has read the victim as admitted and is ending its attempt (held on the
    attempt's row); the launch comes in; then the cycle goes on and commits, then the launch.
    Before the fix the cycle ended the attempt unconditionally while the launch, which took no lock,
    had moved the job to launching; the cycle's move to queued then failed, and the launch wrote
    started_at on the ended attempt and moved the job to running: a running job with no open
    attempt, its processes unseen by every sweep. Now the cycle locks the victim's row and the
    launch claims under the same lock: the claim finds the attempt ended and launches nothing.
    """
    borrower, owed = _borrower_and_owed(tenant, other_tenant, owner, outsider, acme_env, globex_env, flavors)
    gate = gates("launch_job")
    attempt = borrower.attempts.get()
    with rows_locked(JobAttempt.objects.filter(id=attempt.id)):
        the_cycle = InThread(scheduling.cycle_run)
        assert wait_until(lambda: lock_waiters() >= 1), "the cycle should wait to end the victim's attempt"
        the_launch = InThread(attempts.job_launch_run, job_id=borrower.id, attempt_number=1)
        # Now: waiting for the victim's row behind the cycle; before the fix: inside launch_job.
        wait_until(lambda: gate.reached.is_set() or lock_waiters() >= 2)
    the_cycle.outcome()
    gate.opened.set()
    launched = the_launch.outcome()

    borrower.refresh_from_db()
    attempt.refresh_from_db()
    _assert_attempts_match_states()
    assert borrower.state == JobState.QUEUED and f"job {owed.name} of tenant {owed.tenant.slug}" in borrower.reason
    assert (attempt.outcome, attempt.started_at) == ("preempted", None)
    assert launched == "ended"
    assert not gate.reached.is_set(), "nothing may be launched for an ended attempt"
    assert _phase(borrower.id, 1) != "running"


@pytest.mark.django_db(transaction=True)
def test_a_victim_whose_launch_claimed_first_is_preempted_with_a_stop_not_requeued_under_it(
    tenant, other_tenant, owner, outsider, acme_env, globex_env, flavors, gates
):
    """The launch claims first; the cycle decided on a snapshot that still said admitted.

    Forced order: the launch's claim holds the victim's row (held on its lease write); the cycle
    reads the victim as admitted, decides to preempt it and waits for its row; the claim commits
    (launching); the cycle then reads the row fresh. Before the fix the cycle acted on its snapshot:
    it ended the attempt of a job that was launching (the launch then ran it with no open attempt).
    Now the cycle sees launching and preempts with the grace period: the attempt stays open, the
    launch records the start and sends the stop, and the job is requeued only once it stopped.
    (The old launch took no lock, so before the fix this test already fails at the first wait.)
    """
    borrower, owed = _borrower_and_owed(tenant, other_tenant, owner, outsider, acme_env, globex_env, flavors)
    gate = gates("launch_job")
    attempt = borrower.attempts.get()
    with rows_locked(JobAttempt.objects.filter(id=attempt.id)):
        the_launch = InThread(attempts.job_launch_run, job_id=borrower.id, attempt_number=1)
        assert wait_until(lambda: lock_waiters() >= 1), "the claim should hold the job's row, waiting on its attempt's"
        the_cycle = InThread(scheduling.cycle_run)
        assert wait_until(lambda: lock_waiters() >= 2), "the cycle should wait for the victim's row"
    assert gate.reached.wait(30), "the claim went through: the launch is in the backend call"
    decided = the_cycle.outcome()

    borrower.refresh_from_db()
    attempt.refresh_from_db()
    assert decided["preempted"] == [borrower.id]
    assert borrower.state == JobState.PREEMPTED and borrower.stop_deadline is not None
    assert attempt.ended_at is None and attempt.started_at is None
    _assert_attempts_match_states()

    gate.opened.set()
    assert the_launch.outcome() == JobState.PREEMPTED
    attempt.refresh_from_db()
    assert attempt.ended_at is None and attempt.started_at is not None
    _assert_attempts_match_states()
    assert _phase(borrower.id, 1) == "running"

    attempts.job_stop_run(job_id=borrower.id)  # the stop the launch sent after commit, as a worker runs it
    _reconcile_until(lambda: _ended(attempt))
    borrower.refresh_from_db()
    assert borrower.state == JobState.QUEUED
    assert attempt.outcome == "preempted" and attempt.started_at is not None
    _assert_attempts_match_states()
    _assert_nothing_runs_for_ended_attempts()


# --- 2. A launch that outlives the "never started" rule ----------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_reconcile_never_ends_an_attempt_whose_launch_lease_is_live(owner, acme_env, gates, settings):
    """A cancel lands while the launch is inside the backend call; the reconcile runs minutes later.

    Before the fix the reconcile ended an unstarted attempt of a cancelling job once the cancel was
    60 s old, whether or not a launch was in flight; the launch then wrote started_at on the ended
    attempt and, the job being cancelled, nobody ever stopped what it started. Now the attempt
    stays open while its launch lease is live; the launch records the start and the stop goes out,
    and the job ends cancelled with nothing left running.
    """
    settings.JOB_LAUNCH_LEASE_S = 300
    job = _admitted(owner, acme_env, **LONG)
    gate = gates("launch_job")
    the_launch = InThread(attempts.job_launch_run, job_id=job.id, attempt_number=1)
    assert gate.reached.wait(30)
    jobs.job_cancel(actor=owner, job=job)
    Job.objects.filter(id=job.id).update(state_changed_at=timezone.now() - timezone.timedelta(minutes=5))

    reconcile.jobs_reconcile_run()
    attempt = job.attempts.get()
    job.refresh_from_db()
    assert attempt.ended_at is None, "the reconcile ended an attempt whose launch is in flight"
    assert job.state == JobState.CANCELLING

    gate.opened.set()
    assert the_launch.outcome() == JobState.CANCELLING
    attempt.refresh_from_db()
    assert attempt.started_at is not None and attempt.ended_at is None
    _assert_attempts_match_states()

    attempts.job_stop_run(job_id=job.id)  # the stop the launch sent after commit
    _reconcile_until(lambda: _ended(attempt))
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED and attempt.outcome == "cancelled"
    _assert_attempts_match_states()
    _assert_nothing_runs_for_ended_attempts()


@pytest.mark.django_db(transaction=True)
def test_a_launch_whose_lease_ran_out_kills_what_it_started_and_never_runs_beside_the_next_attempt(
    owner, acme_env, gates, settings
):
    """The lease runs out while the launch is held; the reconcile ends the attempt; the job is requeued and
    its next attempt runs; only then does the old launch come back from the backend.

    Before the fix the old launch wrote started_at on the ended attempt and its processes ran beside
    the next attempt's, both training the same job. Now its final write matches nothing (the attempt
    ended): it kills and forgets what it started, and only the next attempt runs.
    """
    settings.JOB_LAUNCH_LEASE_S = 300  # no renewal comes during the test; the test ends the lease itself
    job = _admitted(owner, acme_env, **LONG)
    first_gate = gates("launch_job")
    old_launch = InThread(attempts.job_launch_run, job_id=job.id, attempt_number=1)
    assert first_gate.reached.wait(30)
    node = job.attempts.get().placement[0]["node"]
    assert attempts.jobs_preempt_on_nodes([node], reason="Preempted: test.") == {f"job-{job.id}"}
    job.refresh_from_db()
    assert job.state == JobState.PREEMPTED

    # The launch's worker is stuck: its lease runs out.
    JobAttempt.objects.filter(job=job, number=1).update(launch_lease_until=timezone.now() - timezone.timedelta(seconds=1))
    counts = reconcile.jobs_reconcile_run()
    first = job.attempts.get(number=1)
    job.refresh_from_db()
    assert counts.get("finished") == 1, counts
    assert first.ended_at is not None and first.started_at is None and first.outcome == "preempted"
    assert job.state == JobState.QUEUED

    scheduling.cycle_run()
    job.refresh_from_db()
    assert job.state == JobState.ADMITTED, job.reason
    del Gated.gates["launch_job"]  # the next launch passes; the old one stays held on its own gate
    assert attempts.job_launch_run(job_id=job.id, attempt_number=2) == JobState.RUNNING

    first_gate.opened.set()
    assert old_launch.outcome() == "ended"
    first.refresh_from_db()
    job.refresh_from_db()
    assert first.started_at is None, "the late launch wrote on an ended attempt"
    assert job.state == JobState.RUNNING and job.attempts.get(ended_at__isnull=True).number == 2
    _assert_attempts_match_states()
    _assert_nothing_runs_for_ended_attempts()
    assert _phase(job.id, 2) == "running"


# --- 3. The reconcile: one job at a time, one pass at a time -------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_job_whose_status_read_raises_is_backed_off_while_the_pass_finishes_the_others(owner, acme_env, scripted):
    """Three started jobs whose attempts have ended; the status read of the middle one raises.

    Before the fix the error (anything but a TransientBackendError) left the pass at that job:
    every job after it (in the old order, newest first; in the new one, oldest first: the bad one
    sits between the two) stayed unfinished on every pass, holding its GPUs. Now the pass goes on,
    the bad job is counted, given reconcile_errors and a reconcile_after in the future (skipped
    until then), and once the backend answers again it is handled and its error count cleared.
    """
    before, bad, after = (_admitted(owner, acme_env, name=name) for name in ("before", "bad", "after"))
    attempts = {job.id: _started_without_processes(job) for job in (before, bad, after)}
    Scripted.broken[bad.id] = PermanentBackendError("namespaces is forbidden")

    counts = reconcile.jobs_reconcile_run()
    assert counts["errors"] == 1 and counts["finished"] == 2, counts
    assert _ended(attempts[before.id]) and _ended(attempts[after.id])
    assert not _ended(attempts[bad.id])
    bad.refresh_from_db()
    assert bad.reconcile_errors == 1 and "forbidden" in bad.reconcile_error
    assert bad.reconcile_after is not None and bad.reconcile_after > timezone.now()
    _assert_attempts_match_states()

    assert reconcile.jobs_reconcile_run()["looked"] == 0, "the bad job waits out its backoff"

    Scripted.broken.clear()
    Job.objects.filter(id=bad.id).update(reconcile_after=timezone.now() - timezone.timedelta(seconds=1))
    counts = reconcile.jobs_reconcile_run()
    assert counts["errors"] == 0 and counts["finished"] == 1, counts
    bad.refresh_from_db()
    assert (bad.reconcile_errors, bad.reconcile_error, bad.reconcile_after) == (0, "", None)
    assert _ended(attempts[bad.id])
    _assert_attempts_match_states()


@pytest.mark.django_db(transaction=True)
def test_a_kill_that_raises_past_the_deadline_is_backed_off_and_retried(owner, acme_env, faulty):
    """A preempted job past its deadline still runs and the backend refuses to kill it.

    Before the fix the PermanentBackendError from kill_job left the pass (see above). Now the job is
    backed off, still preempted with its attempt open and its processes running; once the backend
    answers the next pass kills it and the job is requeued.
    """
    job = _admitted(owner, acme_env, **LONG)
    assert attempts.job_launch_run(job_id=job.id, attempt_number=1) == JobState.RUNNING
    job.refresh_from_db()
    assert jobs.transition(job, JobState.PREEMPTED, "test: preempted",
                           stop_deadline=timezone.now() - timezone.timedelta(seconds=1))
    faulty["kill_job"] = PermanentBackendError("pods/exec is forbidden")

    assert reconcile.jobs_reconcile_run()["errors"] == 1
    job.refresh_from_db()
    assert job.reconcile_errors == 1 and job.reconcile_after > timezone.now()
    assert job.state == JobState.PREEMPTED and _phase(job.id, 1) == "running"
    _assert_attempts_match_states()

    faulty.clear()
    Job.objects.filter(id=job.id).update(reconcile_after=timezone.now() - timezone.timedelta(seconds=1))
    assert reconcile.jobs_reconcile_run().get("killed") == 1
    attempt = job.attempts.get()
    _reconcile_until(lambda: _ended(attempt))
    job.refresh_from_db()
    assert job.state == JobState.QUEUED and job.reconcile_errors == 0
    _assert_nothing_runs_for_ended_attempts()


@pytest.mark.django_db(transaction=True)
def test_a_cancel_that_lands_while_the_pass_reads_a_finished_job_ends_it_cancelled(owner, acme_env, gates):
    """The pass has read the job as running and asks the backend how it stands; the job is cancelled then.

    The attempt has in fact finished all its steps. Before the fix the outcome was judged from the
    pass's stale copy (running: succeeded), then written under the lock onto a job now cancelling:
    cancelling -> succeeded is no transition, the ValueError rolled the write back and ended the
    whole pass, on every pass. Now the outcome is decided from the locked row: cancelled.
    """
    job = _admitted(owner, acme_env, steps=1, checkpoint_every_steps=0)
    assert attempts.job_launch_run(job_id=job.id, attempt_number=1) == JobState.RUNNING
    assert wait_until(lambda: _phase(job.id, 1) == "exited", timeout_s=240), "the trainer did not finish its one step"
    assert set(_cluster().job_status(job.id, 1).exit_codes.values()) == {0}

    gate = gates("job_status")
    the_pass = InThread(reconcile.jobs_reconcile_run)
    assert gate.reached.wait(30)
    jobs.job_cancel(actor=owner, job=job)
    gate.opened.set()
    counts = the_pass.outcome()

    job.refresh_from_db()
    attempt = job.attempts.get()
    assert counts["errors"] == 0 and counts["finished"] == 1, counts
    assert job.state == JobState.CANCELLED
    assert attempt.outcome == "cancelled" and attempt.exit_code == 0
    _assert_attempts_match_states()


@pytest.mark.django_db(transaction=True)
def test_a_second_reconcile_pass_skips_while_the_first_runs(owner, acme_env, gates):
    """Two passes at once (a slow pass overlapping the next beat).

    Before the fix both went over the same jobs, each reading, killing and ending the same attempts.
    Now the second sees the first holds the cluster-wide lock and returns {"skipped": 1} at once,
    without a backend call; the first finishes what it read.
    """
    job = _admitted(owner, acme_env)
    attempt = _started_without_processes(job)
    gate = gates("job_status")
    first = InThread(reconcile.jobs_reconcile_run)
    assert gate.reached.wait(30)
    gate.reached.clear()
    assert reconcile.jobs_reconcile_run() == {"skipped": 1}
    assert not gate.reached.is_set(), "the second pass asked the backend"
    gate.opened.set()
    assert first.outcome()["finished"] == 1
    assert _ended(attempt)
    _assert_attempts_match_states()


@pytest.mark.django_db(transaction=True)
def test_an_error_mid_pass_does_not_let_a_second_pass_run_beside_the_first(owner, acme_env, scripted):
    """The first pass meets a job whose status read raises, then reads the next job (held there);
    meanwhile the next beat's pass starts. It must skip: the first still runs.

    The first pass's connection is past its age (CONN_MAX_AGE 0 here; with the default 60 s, any pass
    that straddles the moment its worker's connection turns 60 s old).
    """
    bad, held = _admitted(owner, acme_env, name="bad"), _admitted(owner, acme_env, name="held")
    _started_without_processes(bad)
    attempt = _started_without_processes(held)
    Scripted.broken[bad.id] = PermanentBackendError("namespaces is forbidden")
    gate = Gate()
    Gated.gates["job_status"] = gate

    def first_pass():
        own = connections["default"]
        own.settings_dict = {**own.settings_dict, "CONN_MAX_AGE": 0}
        return reconcile.jobs_reconcile_run()

    first = InThread(first_pass)
    assert gate.reached.wait(30), "the first pass should reach the held job"
    gate.reached.clear()
    second = InThread(reconcile.jobs_reconcile_run)
    second.join(5)
    ran_beside = gate.reached.is_set()
    gate.opened.set()
    first.outcome(), second.outcome()
    assert not ran_beside, "a second pass ran while the first held a job"
    assert _ended(attempt)


# --- 4. Deleting an environment with jobs --------------------------------------------------------


@pytest.mark.django_db
def test_deleting_an_environment_cancels_its_jobs_and_tears_down_only_once_their_attempts_ended(
    owner, tenant, acme_env, django_capture_on_commit_callbacks
):
    """Queued, admitted and running jobs in the environment being deleted.

    Before the fix the delete left the jobs alone: the namespace (here: the workspace) went while
    a trainer still ran in it, the admitted job was launched into a deleted environment, and the
    queued one was admitted later. Now the delete cancels them in its transaction (waiting ones at
    once, the running one with its stop), and the teardown answers deleting while an attempt is
    open, deleted once the last one ended.
    """
    running = _admitted(owner, acme_env, name="running", replicas=1, gpus_per_replica=8, **LONG)
    assert attempts.job_launch_run(job_id=running.id, attempt_number=1) == JobState.RUNNING
    admitted = _admitted(owner, acme_env, name="admitted", replicas=1, gpus_per_replica=8)
    queued = submit(owner, acme_env, name="queued", **ONE_GPU)
    scheduling.cycle_run()
    queued.refresh_from_db()
    assert queued.state == JobState.QUEUED, "all 16 H100s are held"

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        environments.environment_delete(actor=owner, environment=acme_env)
    assert len(callbacks) >= 2, "the teardown and the running job's stop are sent after commit"
    for job in (running, admitted, queued):
        job.refresh_from_db()
    assert (queued.state, admitted.state, running.state) == ("cancelled", "cancelled", "cancelling")
    assert admitted.attempts.get().outcome == "cancelled"
    _assert_attempts_match_states()

    assert environments.environment_teardown_run(environment_id=acme_env.id) == "deleting"
    acme_env.refresh_from_db()
    assert acme_env.state == "deleting" and "1 job attempt" in acme_env.status_message
    assert _phase(running.id, 1) == "running"

    attempts.job_stop_run(job_id=running.id)  # the stop the delete sent after commit
    attempt = running.attempts.get()
    _reconcile_until(lambda: _ended(attempt))
    running.refresh_from_db()
    assert running.state == JobState.CANCELLED and attempt.outcome == "cancelled"
    _assert_nothing_runs_for_ended_attempts()

    assert environments.environment_teardown_run(environment_id=acme_env.id) == "deleted"
    assert Environment.objects.get(id=acme_env.id).state == "deleted"


# --- 6. Answers that do not depend on the cluster ------------------------------------------------

EVERY_JOB_CALL = ("job_logs", "job_status", "job_progress", "stop_job", "kill_job", "forget_job", "launch_job",
                  "jobs_open")


def _cluster_down(failing: dict) -> None:
    for name in EVERY_JOB_CALL:
        failing[name] = TransientBackendError("connection refused")
    failing["stop_job"] = PermanentBackendError("pods is forbidden")


@pytest.mark.django_db
def test_with_the_cluster_failing_logs_answer_503_and_metrics_and_the_job_page_200(
    owner, acme_env, faulty, client_for, client
):
    """Before the fix the logs, metrics and the job page read the backend in the request and answered
    500 on any backend error. Now the logs say 503 naming the backend (with Retry-After), and metrics
    and the page read only what the reconcile recorded."""
    job = _admitted(owner, acme_env)
    _started_without_processes(job)
    _cluster_down(faulty)
    api = client_for(owner)

    logs = api.get(f"/api/v1/jobs/{job.id}/logs/")
    assert logs.status_code == 503, logs.content
    assert "local" in logs.json()["detail"] and "connection refused" in logs.json()["detail"]
    assert logs["Retry-After"]

    metrics = api.get(f"/api/v1/jobs/{job.id}/metrics/")
    assert metrics.status_code == 200, metrics.content
    assert metrics.json()["series"] == []

    client.force_login(owner)
    for path in (f"/jobs/{job.id}/", f"/jobs/{job.id}/live/"):
        page = client.get(path)
        assert page.status_code == 200, (path, page.content[:500])


@pytest.mark.django_db(transaction=True)
def test_a_cancel_answers_202_with_the_cluster_failing_and_makes_no_cluster_call(
    owner, acme_env, faulty, client_for
):
    """Before the fix the cancel committed and then called stop_job in the request (after commit):
    a PermanentBackendError turned the committed cancel into a 500. Now the stop goes to a worker:
    the answer is 202 whatever the cluster does (every job call here raises, so any call in the
    request would fail it)."""
    job = _admitted(owner, acme_env)
    _started_without_processes(job)
    _cluster_down(faulty)

    response = client_for(owner).post(f"/api/v1/jobs/{job.id}/cancel/")
    assert response.status_code == 202, response.content
    assert response.json()["state"] == "cancelling"
    job.refresh_from_db()
    assert job.state == JobState.CANCELLING and job.stop_deadline is not None


# --- 7. No transaction around a cluster call -----------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_inventory_sync_asks_the_cluster_outside_any_transaction(inventory, gates):
    """Before the fix inventory_sync was one transaction.atomic around discover_inventory (a node list
    can take seconds against a real cluster) and every write after it. Now discovery runs with no
    transaction open, and only the writes are in one short transaction."""
    gate = gates("discover_inventory")
    seen = {}

    def sync():
        seen["connection"] = connections["default"]
        return clusters.inventory_sync()

    the_sync = InThread(sync)
    assert gate.reached.wait(30)
    assert seen["connection"].in_atomic_block is False, "discovery runs inside a transaction"
    with connection.cursor() as cursor:
        cursor.execute("SET lock_timeout = '3s'")
    try:
        # Neither the Node table nor a node's row is held while the cluster is asked.
        assert Node.objects.filter(name="h100-node-1").update(seen_at=timezone.now()) == 1
        with transaction.atomic():
            assert Node.objects.select_for_update().filter(pool__name="h100-pool").count() == 2
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
    gate.opened.set()
    assert the_sync.outcome() == {"nodes": 5, "pools": 3, "removed": 0}


# --- 8. A partition change sees jobs admitted but not launched -----------------------------------


@pytest.fixture
def h100_mig(db):
    return PartitionProfile.objects.create(
        name="h100-4g-3g", gpu_model="H100-80GB", kind="mig", layout=["4g.40gb", "3g.40gb"]
    )


@pytest.fixture
def borrowing_env(flavors, tenant, owner):
    """acme on H100 with no guarantee, so re-cutting the pool strands none."""
    give_quota(tenant, flavors["h100-80gb"], guaranteed=0, max=16)
    return ready_environment(actor=owner, tenant=tenant)


@pytest.mark.django_db
def test_an_admitted_job_makes_a_drain_wait_apply_refused_naming_it(owner, staff, borrowing_env, h100_mig, client_for):
    """Before the fix the apply asked only the backend what runs on the pool's nodes: a job admitted
    there and not launched yet runs nothing, so the change went ahead and re-cut the GPUs it was
    placed on. Now the job's open attempt counts as work on its node."""
    job = _admitted(owner, borrowing_env)
    node = job.attempts.get().placement[0]["node"]
    pool = NodePool.objects.get(name="h100-pool")
    assert f"{borrowing_env.namespace}/job-{job.id}" in clusters.pool_workloads(pool)[node]

    response = client_for(staff).post(f"/api/v1/node-pools/{pool.id}/apply/", {"profile": h100_mig.name, "drain": "wait"})
    assert response.status_code == 400, response.content
    assert f"job-{job.id}" in response.json()["drain"][0]
    assert not PartitionChange.objects.exists()


@pytest.mark.django_db
def test_the_cordon_step_refuses_a_drain_wait_change_when_a_job_was_admitted_after_the_apply(
    owner, staff, borrowing_env, h100_mig, client_for, django_capture_on_commit_callbacks
):
    """The apply is accepted on an idle pool; a job is admitted onto it before the change's first step.

    Before the fix the cordon step, too, asked only the backend: it found nothing, relabeled the
    nodes and the admitted job was launched onto GPUs that no longer existed as placed. Now the
    step refuses, naming the job, and hands the nodes back; the job keeps its placement.
    """
    pool = NodePool.objects.get(name="h100-pool")
    with django_capture_on_commit_callbacks(execute=False):
        response = client_for(staff).post(f"/api/v1/node-pools/{pool.id}/apply/",
                                          {"profile": h100_mig.name, "drain": "wait"})
    assert response.status_code == 202, response.content
    job = _admitted(owner, borrowing_env)

    assert drive_partition_change(response.json()["id"]) == PartitionChange.State.REFUSED
    change = PartitionChange.objects.get(id=response.json()["id"])
    assert f"{borrowing_env.namespace}/job-{job.id}" in change.message
    job.refresh_from_db()
    assert job.state == JobState.ADMITTED and job.attempts.get(ended_at__isnull=True)
    assert all(Node.objects.filter(pool=pool).values_list("schedulable", flat=True))
    assert Node.objects.get(name="h100-node-1").gpu_resources == {"nvidia.com/gpu": 8}


# --- 11. A launch lost with its worker -----------------------------------------------------------


@pytest.mark.django_db
def test_a_launch_whose_worker_died_is_sent_again_under_a_fresh_token_once_its_lease_ran_out(owner, acme_env):
    """A worker claimed the attempt (launching, its token, a lease), died before launch_job, and its
    message is gone. Before the fix the reconcile resent launches only for admitted jobs and skipped
    a launching job with no started attempt: it stayed launching for good, holding its GPUs. Now,
    once the lease ran out, one pass reserves a fresh token with a new lease and sends the launch;
    the launch with that token runs it, and the dead worker's token, should its message come back,
    does nothing."""
    job = _admitted(owner, acme_env, **LONG)
    assert jobs.transition(job, JobState.LAUNCHING, "Launching attempt 1.")
    dead = str(uuid.uuid4())
    JobAttempt.objects.filter(job=job).update(
        launch_token=dead, launch_lease_until=timezone.now() + timezone.timedelta(seconds=60)
    )
    assert reconcile.jobs_reconcile_run().get("launching") == 1, "a live lease is left alone"
    assert job.attempts.get().launch_token == dead

    JobAttempt.objects.filter(job=job).update(launch_lease_until=timezone.now() - timezone.timedelta(seconds=1))
    before = timezone.now()
    assert reconcile.jobs_reconcile_run().get("relaunched") == 1
    attempt = job.attempts.get()
    fresh = attempt.launch_token
    assert fresh and fresh != dead
    assert attempt.launch_lease_until > before
    assert any(fresh in sent and str(job.id) in sent for sent in _sent_job_launches()), "no job_launch was sent"

    assert attempts.job_launch_run(job_id=job.id, attempt_number=1, token=dead) == JobState.LAUNCHING
    assert _phase(job.id, 1) != "running" and job.attempts.get().launch_token == fresh

    assert attempts.job_launch_run(job_id=job.id, attempt_number=1, token=fresh) == JobState.RUNNING
    attempt.refresh_from_db()
    assert attempt.started_at is not None and _phase(job.id, 1) == "running"
    assert attempts.job_launch_run(job_id=job.id, attempt_number=1, token=dead) == JobState.RUNNING
    _assert_attempts_match_states()


# --- 12. Idempotent submits ----------------------------------------------------------------------


def _post(client, data, key=None):
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key is not None else {}
    return client.post("/api/v1/jobs/", data, format="json", **headers)


@pytest.mark.django_db
def test_a_submit_repeated_with_its_idempotency_key_answers_the_same_job(owner, acme_env, client_for):
    """Before the fix a client that retried a submit whose answer it lost (a 500 after the commit, a
    dropped connection) made a second job. Now the same key and body answer the first job (200),
    and the same key with another body is refused naming the header."""
    api = client_for(owner)
    data = job_data(acme_env, name="keyed", **ONE_GPU)
    first = _post(api, data, key="retry-1")
    again = _post(api, data, key="retry-1")
    assert (first.status_code, again.status_code) == (201, 200), (first.content, again.content)
    assert first.json()["id"] == again.json()["id"]
    assert Job.objects.count() == 1

    other = _post(api, {**data, "steps": 41}, key="retry-1")
    assert other.status_code == 400, other.content
    assert "Idempotency-Key" in other.json()
    assert Job.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_submits_at_once_with_one_idempotency_key_make_one_job(owner, tenant, acme_env, client_for):
    """Both requests look the key up (nothing yet), then meet at the tenant's row lock; the first
    writes the job and the key, the second's key insert collides and it answers the first's job.
    Before the fix there was no key: two jobs."""
    data = job_data(acme_env, name="keyed", **ONE_GPU)
    clients = [client_for(owner), client_for(owner)]
    with rows_locked(Tenant.objects.filter(id=tenant.id)):
        posts = [InThread(_post, client=api, data=data, key="same-moment") for api in clients]
        wait_until(lambda: lock_waiters() >= 2)  # both past the key lookup, waiting to write
    answers = [post.outcome() for post in posts]

    assert sorted(answer.status_code for answer in answers) == [200, 201], [a.content for a in answers]
    assert answers[0].json()["id"] == answers[1].json()["id"]
    assert Job.objects.count() == 1 and IdempotencyKey.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_submit_whose_database_connection_dies_after_the_write_answers_503_and_a_retry_creates_it(
    owner, acme_env, client_for
):
    """The submit has written its job and waits to write its key (another transaction holds the
    same key, uncommitted); its database connection is then terminated. Before the fix any
    DatabaseError in a view answered 500, telling the client nothing of whether to retry. Now it
    answers 503 with Retry-After; nothing was committed, and a retry with the same key creates the job."""
    api = client_for(owner)
    placeholder = submit(owner, acme_env, name="placeholder", **ONE_GPU)
    data = job_data(acme_env, name="keyed", **ONE_GPU)
    held, release = threading.Event(), threading.Event()

    def hold_the_key():
        with transaction.atomic():
            IdempotencyKey.objects.create(user=owner, key="dies", request_hash="0" * 64, job=placeholder)
            held.set()
            release.wait(60)
            transaction.set_rollback(True)

    holder = InThread(hold_the_key)
    assert held.wait(10)
    try:
        post = InThread(_post, client=api, data=data, key="dies")
        assert wait_until(lambda: lock_waiters() >= 1), "the submit should wait on the held key"
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        answer = post.outcome()
    finally:
        release.set()
        holder.outcome()
    assert answer.status_code == 503, answer.content
    assert answer["Retry-After"]
    assert not Job.objects.filter(name="keyed").exists(), "the job was written though the request failed"

    retried = _post(api, data, key="dies")
    assert retried.status_code == 201, retried.content
    assert Job.objects.filter(name="keyed").count() == 1
