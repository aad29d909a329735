"""Celery tasks of training jobs: launch an attempt, stop one, reconcile them all.

Each task has an explicit, stable name (the module path it had before the apps were split):
renaming one strands the messages queued under the old name, so tests/test_task_names.py lists
them all.
"""

from celery import shared_task

from common.dispatch import retry_or_give_up
from runners.backends.base import TransientBackendError
from runners.jobs import attempts, checkpoint_store, reconcile

JOB_LAUNCH_MAX_RETRIES = 6


@shared_task(name="runners.tasks.job_launch", bind=True, acks_late=True, max_retries=JOB_LAUNCH_MAX_RETRIES)
def job_launch(self, job_id: int, attempt_number: int, token: str | None = None) -> str:
    """Launch one attempt. ``token`` is the reconcile's when it sent the launch again; otherwise the
    message's own id, which its retries keep, so a retry holds the same launch lease."""
    token = token or self.request.id
    try:
        return attempts.job_launch_run(job_id=job_id, attempt_number=attempt_number, token=token)
    except TransientBackendError as exc:
        return retry_or_give_up(
            self, exc, cap_s=30,
            give_up=lambda reason: attempts.job_launch_give_up(
                job_id=job_id, attempt_number=attempt_number, reason=reason, token=token
            ),
        )


@shared_task(
    name="runners.tasks.job_stop", acks_late=True, autoretry_for=(TransientBackendError,), retry_backoff=2, retry_backoff_max=30,
             max_retries=5)
def job_stop(job_id: int) -> str:
    """Tell a preempted or cancelled job's attempt to checkpoint and stop; the reconcile asks again if this is lost."""
    return attempts.job_stop_run(job_id=job_id)


@shared_task(name="runners.tasks.jobs_reconcile")
def jobs_reconcile() -> dict:
    return reconcile.jobs_reconcile_run()


@shared_task(name="runners.jobs.tasks.checkpoint_store", acks_late=True, autoretry_for=(TransientBackendError,),
             retry_backoff=2, retry_backoff_max=60, max_retries=8)
def checkpoint_store_task(checkpoint_id: int) -> str:
    """Copy one checkpoint into the checkpoint store (chunked, deduplicated); the script never waits for it."""
    return checkpoint_store.checkpoint_store_run(checkpoint_id)


@shared_task(name="runners.jobs.tasks.checkpoints_sweep")
def checkpoints_sweep() -> dict:
    """Apply every tenant's checkpoint retention, then delete the chunks no checkpoint names."""
    return checkpoint_store.checkpoints_sweep_run()
