"""The reconcile: one pass at a time, cluster-wide, that finds every open attempt again from the
database and drives it on (see the ownership rule in runners/jobs/attempts.py).

Each job is handled in isolation: one job's error is logged, counted and retried with backoff for
that job while the pass goes on. Outcomes are decided from the locked row.
"""

from __future__ import annotations

import contextlib
import logging
import uuid

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from common.dispatch import send_task
from common.locks import one_pass_at_a_time
from runners.clusters.registry import get_backend
from runners.jobs.attempts import (
    _kill_and_forget,
    _lease_live,
    _lease_until,
    attempt_end,
    open_attempt,
    open_attempts,
    progress_record,
)
from runners.jobs.models import (
    JOB_HOLDING_STATES,
    AttemptOutcome,
    Job,
    JobAttempt,
    JobState,
)
from runners.jobs.services import transition

logger = logging.getLogger(__name__)

# pg_advisory_lock's key for the reconcile: "reconc" in ASCII.
RECONCILE_LOCK_KEY = 0x7265636F6E63
# Between a running job's reason and why its attempt still waits for pods (the backend's `waiting`).
WAITING_MARK = " Now: "


def _show_waiting(job: Job, waiting: str) -> None:
    """A running job's reason says why its attempt waits (the cluster refuses its pods), or no longer does.

    The reason is the one its move to running wrote, with the backend's `waiting` after WAITING_MARK;
    it is written only when that changes, and only over the reason this pass read (a compare-and-set:
    a transition meanwhile keeps its own). No JobEvent: the state does not change.
    """
    if job.state != JobState.RUNNING:
        return
    shown = job.reason.partition(WAITING_MARK)[0]
    wanted = f"{shown}{WAITING_MARK}{waiting}"[:1000] if waiting else shown
    if wanted != job.reason and Job.objects.filter(id=job.id, state=job.state, reason=job.reason).update(reason=wanted):
        job.reason = wanted


def _reconcile_one(backend, job: Job, attempt: JobAttempt | None, now) -> str:
    """Drive one job on; returns what was done (for the pass's counts)."""
    if attempt is None:
        # A job holding nothing cannot stay in a holding state: the rules above never leave one
        # so, but if one is found it is driven on rather than left to hold GPUs nobody sees.
        with transaction.atomic():
            locked = Job.objects.select_for_update(of=("self",)).get(id=job.id)
            if locked.state not in JOB_HOLDING_STATES or open_attempt(locked) is not None:
                return "moved"
            logger.error("Job %s was %s with no open attempt; moving it on.", job.id, locked.state)
            if locked.state == JobState.CANCELLING:
                transition(locked, JobState.CANCELLED, locked.reason)
            else:
                transition(locked, JobState.QUEUED, "Requeued: it held no GPUs; it waits for the scheduler again.",
                           stop_deadline=None)
        return "repaired"
    if attempt.started_at is None:
        return _reconcile_unstarted(job, attempt, now)
    status = backend.job_status(job.id, attempt.number)
    finished = status.phase != "running"
    progress_record(job, attempt, backend, drain=finished)
    if not finished:
        _show_waiting(job, status.waiting)
        if job.stop_deadline and now >= job.stop_deadline:
            backend.kill_job(job.id, attempt.number)
            return "killed"
        told_s = (now - job.state_changed_at).total_seconds()
        if job.state in (JobState.PREEMPTED, JobState.CANCELLING) and told_s >= settings.JOB_LAUNCH_RESEND_AFTER_S:
            # The stop message may have been lost: asking again is harmless (the trainer ignores a repeat).
            backend.stop_job(job.id, attempt.number, grace_period_s=settings.PREEMPTION_GRACE_PERIOD_S)
        return "running"
    if status.node_lost:
        # The node is gone: take it out of the inventory before the job is placed again.
        from runners.clusters.services import inventory_sync

        inventory_sync()
    return "finished" if attempt_end(job.id, attempt.id, status=status) else "moved"


def _reconcile_unstarted(job: Job, attempt: JobAttempt, now) -> str:
    if _lease_live(attempt, now):
        return "launching"  # its launch (or a message reserved for it) is in flight
    if job.state in (JobState.CANCELLING, JobState.PREEMPTED):
        outcome = AttemptOutcome.CANCELLED if job.state == JobState.CANCELLING else AttemptOutcome.PREEMPTED
        if attempt_end(job.id, attempt.id, outcome=outcome, reason=f"{job.reason} It had not started yet.",
                       never_started=True):
            # A launcher that died after starting it leaves no mark but what it started.
            _kill_and_forget(job.id, attempt.number)
            return "finished"
        return "moved"
    waited_since = max(filter(None, [job.state_changed_at, attempt.launch_lease_until]))
    if job.state == JobState.LAUNCHING or (now - waited_since).total_seconds() >= settings.JOB_LAUNCH_RESEND_AFTER_S:
        # Admitted with no claim for a while (the message was lost), or its launcher died mid-launch
        # (the lease ran out): launch again under a fresh token; the launch is idempotent.
        token = str(uuid.uuid4())
        reserved = JobAttempt.objects.open().filter(
            id=attempt.id, started_at__isnull=True
        ).filter(Q(launch_lease_until__isnull=True) | Q(launch_lease_until__lte=now)).update(
            launch_token=token, launch_lease_until=_lease_until()
        )
        if reserved:
            send_task("runners.tasks.job_launch", job.id, attempt.number, token)
            return "relaunched"
    return "waiting"


def _backoff(job: Job, exc: Exception) -> None:
    errors = job.reconcile_errors + 1
    delay = min(settings.JOB_RECONCILE_BACKOFF_MAX_S, settings.JOB_RECONCILE_INTERVAL_S * 2 ** min(errors, 16))
    Job.objects.filter(id=job.id).update(
        reconcile_errors=errors, reconcile_error=f"{type(exc).__name__}: {exc}"[:1000],
        reconcile_after=timezone.now() + timezone.timedelta(seconds=delay),
    )


def jobs_reconcile_run() -> dict[str, int]:
    """One pass over every job that holds (or is about to hold) GPUs; returns counts of what it did."""
    with one_pass_at_a_time(RECONCILE_LOCK_KEY, "reconcile") as held:
        if not held:
            return {"skipped": 1}
        backend = get_backend()
        now = timezone.now()
        holding = Job.objects.filter(state__in=JOB_HOLDING_STATES)
        attempts = open_attempts(holding)
        namespaces = dict(holding.values_list("id", "environment__namespace"))
        backend.jobs_open({(attempt.job_id, attempt.number): namespaces.get(attempt.job_id)
                           for attempt in attempts.values()})
        jobs = list(
            holding.filter(Q(reconcile_after__isnull=True) | Q(reconcile_after__lte=now))
            .select_related("tenant", "environment", "flavor").order_by("reconcile_errors", "id")
        )
        counts: dict[str, int] = {"looked": 0, "finished": 0, "errors": 0}
        for job in jobs:
            counts["looked"] += 1
            try:
                done = _reconcile_one(backend, job, attempts.get(job.id), now)
            except Exception as exc:  # one job's trouble never stops the pass
                logger.exception("Reconciling job %s failed; retrying it with backoff", job.id)
                counts["errors"] += 1
                if connection.connection is not None and not connection.is_usable():
                    # The database connection died, and the pass's lock with it: another pass may
                    # start now, so this one stops; the next beat's pass carries on.
                    logger.error("The reconcile lost its database connection; ending this pass.")
                    connection.close()
                    counts["aborted"] = 1
                    break
                with contextlib.suppress(Exception):
                    _backoff(job, exc)
                continue
            counts[done] = counts.get(done, 0) + 1
            if job.reconcile_errors:
                Job.objects.filter(id=job.id).update(reconcile_errors=0, reconcile_error="", reconcile_after=None)
        return counts
