"""Launching attempts and reading how they end: what the workers do between scheduler cycles.

- ``job_launch_run`` (task ``job_launch``, sent after the cycle commits an admission):
  admitted -> launching -> running. The backend call is idempotent and made with no row
  lock held; state moves are compare-and-set, so a redelivered message does no harm.
- ``jobs_reconcile_run`` (beat, every JOB_RECONCILE_INTERVAL_S): for each launched attempt,
  the backend's view from the outside (processes or pods), new checkpoints recorded, a
  victim past its grace period killed, and an attempt that ended finished: succeeded,
  preempted or its node lost (requeued, resuming from the newest checkpoint), failed
  (retried up to max_retries), or cancelled.
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from portal.tasks import send_task
from quotas.selectors import flavor_kubernetes_resource
from runners.backends.base import JobLaunch, PermanentBackendError, ReplicaPlacement, TransientBackendError
from runners.jobs import transition
from runners.models import AttemptOutcome, Checkpoint, Job, JobAttempt, JobState
from runners.registry import get_backend
from runners.workloads.progress import EXIT_CHECKPOINTED_ON_SIGNAL, EXIT_OK

logger = logging.getLogger(__name__)
# A job admitted this long ago and still not launching lost its launch message.
LAUNCH_LOST_AFTER_S = 60


def current_attempt(job: Job) -> JobAttempt | None:
    return job.attempts.filter(ended_at__isnull=True).order_by("-number").first()


def runtime_left_s(job: Job, attempt: JobAttempt) -> int:
    """What is left of the job's max_runtime_s for this attempt, after the earlier ones ran."""
    used_s = sum(
        (a.ended_at - a.started_at).total_seconds()
        for a in job.attempts.exclude(id=attempt.id).filter(started_at__isnull=False, ended_at__isnull=False)
    )
    return max(1, int(job.spec["max_runtime_s"] - used_s))


def job_launch_spec(job: Job, attempt: JobAttempt) -> JobLaunch:
    spec = job.spec
    return JobLaunch(
        job_id=job.id,
        attempt=attempt.number,
        tenant_slug=job.tenant.slug,
        namespace=job.environment.namespace,
        name=job.name,
        template=spec["template"],
        replicas=tuple(
            ReplicaPlacement(
                rank=replica["replica"], node=replica["node"], gpus=tuple(replica["gpus"]),
                mig_profile=replica.get("mig_profile"), mig_start=replica.get("mig_start"),
            )
            for replica in attempt.placement
        ),
        gpu_resource=flavor_kubernetes_resource(job.flavor),
        gpus_per_replica=job.gpus_per_replica,
        cpu_milli_per_replica=spec["cpu_milli_per_replica"],
        memory_mib_per_replica=spec["memory_mib_per_replica"],
        steps=spec["steps"],
        checkpoint_every_steps=spec["checkpoint_every_steps"],
        max_runtime_s=runtime_left_s(job, attempt),
        env=tuple(sorted(spec["env"].items())),
        image=spec.get("image"),
        command=tuple(spec["command"]) if spec.get("command") else None,
        grace_period_s=settings.PREEMPTION_GRACE_PERIOD_S,
        resume_from_step=job.checkpoints.order_by("-step").values_list("step", flat=True).first(),
    )


def job_launch_run(*, job_id: int, attempt_number: int) -> str:
    job = Job.objects.select_related("tenant", "environment", "flavor").get(id=job_id)
    attempt = job.attempts.get(number=attempt_number)
    if attempt.ended_at is not None:
        return "ended"
    if job.state == JobState.ADMITTED:
        if not transition(job, JobState.LAUNCHING, f"Launching attempt {attempt_number}."):
            return Job.objects.get(id=job_id).state
    elif job.state != JobState.LAUNCHING:  # a redelivered message after the launch went through
        return job.state
    try:
        resumed = get_backend().launch_job(job_launch_spec(job, attempt))
    except PermanentBackendError as exc:
        attempt_finish(job, attempt, outcome=AttemptOutcome.FAILED, reason=f"Could not launch: {exc}")
        return Job.objects.get(id=job_id).state
    now = timezone.now()
    JobAttempt.objects.filter(id=attempt.id).update(started_at=now, resumed_from_step=resumed)
    where = ", ".join(sorted({replica["node"] for replica in attempt.placement}))
    detail = f"resumed from step {resumed}" if resumed else "from the start"
    if transition(job, JobState.RUNNING, f"Running on {where} ({detail})."):
        return JobState.RUNNING
    # Cancelled or preempted while it launched: its stop found nothing started, so stop it now.
    job.refresh_from_db()
    if job.state in (JobState.CANCELLING, JobState.PREEMPTED):
        get_backend().stop_job(job.id, attempt.number, grace_period_s=settings.PREEMPTION_GRACE_PERIOD_S)
    return job.state


def job_launch_give_up(*, job_id: int, attempt_number: int, reason: str) -> None:
    job = Job.objects.get(id=job_id)
    attempt = job.attempts.get(number=attempt_number)
    if attempt.ended_at is None and job.state in (JobState.ADMITTED, JobState.LAUNCHING):
        attempt_finish(job, attempt, outcome=AttemptOutcome.FAILED, reason=f"Could not launch: {reason}")


def stop_attempt(job_id: int) -> None:
    """Tell a job's running attempt to checkpoint and stop (after commit of a preemption or cancel)."""
    job = Job.objects.get(id=job_id)
    attempt = current_attempt(job)
    if attempt is None or attempt.started_at is None:
        return  # not launched yet: the launch sees the state and the reconcile ends it
    try:
        get_backend().stop_job(job.id, attempt.number, grace_period_s=settings.PREEMPTION_GRACE_PERIOD_S)
    except TransientBackendError as exc:
        logger.warning("Could not stop job %s yet (the reconcile retries): %s", job_id, exc)


# --- Finishing an attempt ------------------------------------------------------------


def _record_checkpoints(job: Job, attempt: JobAttempt | None, checkpoints: list[dict]) -> None:
    known = set(job.checkpoints.values_list("step", flat=True))
    new = []
    for record in checkpoints:
        if record["step"] in known:
            continue
        created = record.get("created_at")
        try:
            created_at = datetime.fromisoformat(created) if created else timezone.now()
        except ValueError:
            created_at = timezone.now()
        new.append(Checkpoint(job=job, attempt=attempt, step=record["step"], uri=str(record.get("path", ""))[:1000],
                              bytes=int(record.get("bytes") or 0), created_at=created_at))
        known.add(record["step"])
    Checkpoint.objects.bulk_create(new, ignore_conflicts=True)


def attempt_finish(job: Job, attempt: JobAttempt, *, outcome: str, reason: str, exit_code: int | None = None) -> None:
    """End the attempt and move the job on: done, cancelled, requeued, or failed past its retries."""
    from runners.cycle import kick_cycle

    with transaction.atomic():
        job = Job.objects.select_for_update().get(id=job.id)
        ended = JobAttempt.objects.filter(id=attempt.id, ended_at__isnull=True).update(
            ended_at=timezone.now(), outcome=outcome, reason=reason[:1000], exit_code=exit_code
        )
        if not ended:
            return
        newest = job.checkpoints.order_by("-step").values_list("step", flat=True).first()
        resume = f" It resumes from step {newest}." if newest else ""
        if outcome == AttemptOutcome.SUCCEEDED:
            transition(job, JobState.SUCCEEDED, f"Finished all {job.spec['steps']} steps.")
        elif outcome == AttemptOutcome.CANCELLED or job.state == JobState.CANCELLING:
            transition(job, JobState.CANCELLED, job.reason if job.state == JobState.CANCELLING else reason)
        elif outcome in (AttemptOutcome.PREEMPTED, AttemptOutcome.NODE_LOST):
            transition(job, JobState.QUEUED, f"{reason}{resume}", stop_deadline=None)
        else:
            failures = job.failures + 1
            if failures > job.spec["max_retries"]:
                transition(job, JobState.FAILED, f"{reason} (failed {failures} times; max_retries is "
                                                 f"{job.spec['max_retries']}).", failures=failures)
            else:
                transition(job, JobState.QUEUED, f"Retrying ({failures} of {job.spec['max_retries']}) after: {reason}"
                                                 f"{resume}", failures=failures, stop_deadline=None)
        transaction.on_commit(kick_cycle)
    try:
        get_backend().forget_job(job.id, attempt.number)
    except TransientBackendError:
        pass  # harmless: only bookkeeping of a finished attempt


def _outcome(job: Job, attempt: JobAttempt, status) -> tuple[str, str, int | None]:
    codes = status.exit_codes
    failing = {rank: code for rank, code in codes.items() if code not in (EXIT_OK, EXIT_CHECKPOINTED_ON_SIGNAL)}
    first_failing = min(failing.items()) if failing else None
    if status.node_lost:
        return AttemptOutcome.NODE_LOST, status.reason, None
    if job.state == JobState.CANCELLING:
        return AttemptOutcome.CANCELLED, job.reason, first_failing[1] if first_failing else max(codes.values(), default=None)
    if status.phase == "exited" and codes and not failing and all(code == EXIT_OK for code in codes.values()):
        return AttemptOutcome.SUCCEEDED, "Every replica finished.", EXIT_OK
    if job.state == JobState.PREEMPTED:
        # Stopped as asked: checkpointed (75), or killed after the grace period (the steps since
        # the last checkpoint are lost, the job still resumes from it).
        code = first_failing[1] if first_failing else (EXIT_CHECKPOINTED_ON_SIGNAL if codes else None)
        return AttemptOutcome.PREEMPTED, job.reason, code
    if first_failing:
        rank, code = first_failing
        return AttemptOutcome.FAILED, f"Replica {rank} exited with {code}.", code
    if status.phase == "lost":
        return AttemptOutcome.FAILED, status.reason, None
    # Stopped with a checkpoint though the portal asked nothing: its runtime budget ran out,
    # or something outside (a drained node) stopped it.
    runtime = (timezone.now() - attempt.started_at).total_seconds() if attempt.started_at else 0
    if runtime >= runtime_left_s(job, attempt):
        return AttemptOutcome.FAILED, f"Ran past max_runtime_s ({job.spec['max_runtime_s']} s).", EXIT_CHECKPOINTED_ON_SIGNAL
    return AttemptOutcome.PREEMPTED, "Stopped from outside the portal (the node was drained).", EXIT_CHECKPOINTED_ON_SIGNAL


def jobs_reconcile_run() -> dict[str, int]:
    """One pass over launched attempts; returns how many it looked at and finished."""
    backend = get_backend()
    now = timezone.now()
    looked = finished = 0
    nodes_lost = False
    stale = now - timezone.timedelta(seconds=LAUNCH_LOST_AFTER_S)
    jobs = list(Job.objects.filter(
        state__in=[JobState.LAUNCHING, JobState.RUNNING, JobState.PREEMPTED, JobState.CANCELLING]
    ).select_related("tenant", "environment", "flavor"))
    # Each job's open attempt, in one query rather than one per job.
    open_attempts = {
        attempt.job_id: attempt
        for attempt in JobAttempt.objects.filter(job__in=jobs, ended_at__isnull=True).order_by("number")
    }
    for job in jobs:
        attempt = open_attempts.get(job.id)
        if attempt is None:
            continue
        if attempt.started_at is None:
            # Told to stop before its launch went through, and the launch never came: end it here.
            if job.state in (JobState.CANCELLING, JobState.PREEMPTED) and job.state_changed_at < stale:
                outcome = AttemptOutcome.CANCELLED if job.state == JobState.CANCELLING else AttemptOutcome.PREEMPTED
                attempt_finish(job, attempt, outcome=outcome, reason=f"{job.reason} (before it started)")
                finished += 1
            continue
        looked += 1
        try:
            status = backend.job_status(job.id, attempt.number)
            _record_checkpoints(job, attempt, backend.job_checkpoints(job.id))
        except TransientBackendError as exc:
            logger.warning("Could not read job %s: %s", job.id, exc)
            continue
        if status.phase == "running":
            if job.stop_deadline and now >= job.stop_deadline:
                backend.kill_job(job.id, attempt.number)
            continue
        outcome, reason, code = _outcome(job, attempt, status)
        if outcome == AttemptOutcome.NODE_LOST and not nodes_lost:
            # The node is gone: take it out of the inventory before the job is placed again.
            from runners.services import inventory_sync

            inventory_sync()
            nodes_lost = True
        attempt_finish(job, attempt, outcome=outcome, reason=reason, exit_code=code)
        finished += 1
    # Admitted jobs whose launch message was lost.
    for job in Job.objects.filter(state=JobState.ADMITTED, state_changed_at__lt=stale):
        attempt = current_attempt(job)
        if attempt is not None:
            from runners.tasks import job_launch

            send_task(job_launch, job.id, attempt.number)
    return {"looked": looked, "finished": finished}
