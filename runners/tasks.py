"""Celery tasks for environments, the inventory and partition changes: take ids, reload, call a service."""

from celery import shared_task
from celery.exceptions import MaxRetriesExceededError
from django.conf import settings

from portal.tasks import retry_or_give_up, send_task
from runners import cycle, environments, launch, services
from runners.backends.base import TransientBackendError
from runners.models import EnvironmentState

PARTITION_MAX_RETRIES = 10
ENVIRONMENT_MAX_RETRIES = 8


@shared_task(bind=True, acks_late=True, max_retries=PARTITION_MAX_RETRIES)
def partition_apply(self, change_id: int, lease: str | None = None) -> str:
    """One step of a partition change, then the next step is sent with a countdown: no worker waits."""
    try:
        state, delay_s, next_lease = services.partition_change_step(change_id=change_id, lease=lease)
    except TransientBackendError as exc:
        return retry_or_give_up(
            self,
            exc,
            give_up=lambda reason: services.partition_change_give_up(change_id=change_id, reason=reason),
            before_retry=lambda reason: services.partition_change_release(change_id=change_id),
            cap_s=60,
        )
    if delay_s is not None:
        # Lost (the broker is down): the change's lease runs out and the sweep sends it again.
        send_task(partition_apply, change_id, next_lease, countdown=delay_s)
    return state


@shared_task
def partition_change_sweep() -> list[int]:
    return services.partition_change_sweep(stuck_after_s=settings.STUCK_AFTER_S)


@shared_task(autoretry_for=(TransientBackendError,), retry_backoff=5, max_retries=3)
def inventory_sync() -> dict[str, int]:
    counts = services.inventory_sync()
    counts["flavors_created"] = len(services.flavors_discover())
    return counts


@shared_task(bind=True, acks_late=True, max_retries=ENVIRONMENT_MAX_RETRIES)
def environment_provision(self, environment_id: int) -> str:
    try:
        return environments.environment_provision_run(environment_id=environment_id)
    except TransientBackendError as exc:
        return retry_or_give_up(
            self,
            exc,
            give_up=lambda reason: environments.environment_provision_give_up(environment_id=environment_id, reason=reason),
            before_retry=lambda reason: environments.environment_note_retry(environment_id=environment_id, reason=reason),
            cap_s=120,
        )


@shared_task(
    bind=True,
    acks_late=True,
    autoretry_for=(TransientBackendError,),
    retry_backoff=2,
    # Each attempt touches the row, so with attempts under a minute apart the sweep
    # (STUCK_AFTER_S) never starts a second chain beside a live one.
    retry_backoff_max=60,
    max_retries=50,  # After that the sweep re-enqueues it: teardown always finishes eventually.
)
def environment_teardown(self, environment_id: int) -> str:
    state = environments.environment_teardown_run(environment_id=environment_id)
    if state != EnvironmentState.DELETING:
        return state
    # Not gone yet (a namespace Terminating): ask again later rather than wait here.
    try:
        raise self.retry(countdown=teardown_countdown_s(self.request.retries))
    except MaxRetriesExceededError:
        return state  # The sweep picks the environment up again.


def teardown_countdown_s(retries: int) -> float:
    """Seconds before teardown looks again at an environment still going away: 1, 2, 4 ... 30."""
    return float(min(2**retries, 30))


@shared_task(
    bind=True,
    acks_late=True,
    autoretry_for=(TransientBackendError,),
    retry_backoff=2,
    retry_backoff_max=120,
    max_retries=ENVIRONMENT_MAX_RETRIES,
)
def environment_sync(self, environment_id: int) -> bool:
    return environments.environment_sync_run(environment_id=environment_id)


@shared_task
def environment_sweep() -> dict[str, list[int]]:
    return environments.environment_sweep_run(stuck_after_s=settings.STUCK_AFTER_S)


# --- Jobs ----------------------------------------------------------------------------

JOB_LAUNCH_MAX_RETRIES = 6


@shared_task(acks_late=True)
def scheduler_cycle(kicked_at: float | None = None) -> dict:
    """One scheduler cycle (beat every SCHEDULER_CYCLE_INTERVAL_S, and kicked on submit, finish and cancel).

    A kick that a cycle started after has nothing left to do (that cycle saw what the kick was
    for) and returns at once, so a burst of submits costs one cycle, not one per submit.
    """
    if kicked_at is not None and cycle.cycle_ran_since(kicked_at):
        return {"skipped": True}
    result = cycle.cycle_run()
    return {key: len(value) if isinstance(value, list) else value for key, value in result.items()}


@shared_task(bind=True, acks_late=True, max_retries=JOB_LAUNCH_MAX_RETRIES)
def job_launch(self, job_id: int, attempt_number: int, token: str | None = None) -> str:
    """Launch one attempt. ``token`` is the reconcile's when it sent the launch again; otherwise the
    message's own id, which its retries keep, so a retry holds the same launch lease."""
    token = token or self.request.id
    try:
        return launch.job_launch_run(job_id=job_id, attempt_number=attempt_number, token=token)
    except TransientBackendError as exc:
        return retry_or_give_up(
            self, exc, cap_s=30,
            give_up=lambda reason: launch.job_launch_give_up(
                job_id=job_id, attempt_number=attempt_number, reason=reason, token=token
            ),
        )


@shared_task(acks_late=True, autoretry_for=(TransientBackendError,), retry_backoff=2, retry_backoff_max=30,
             max_retries=5)
def job_stop(job_id: int) -> str:
    """Tell a preempted or cancelled job's attempt to checkpoint and stop; the reconcile asks again if this is lost."""
    return launch.job_stop_run(job_id=job_id)


@shared_task
def jobs_reconcile() -> dict:
    return launch.jobs_reconcile_run()
