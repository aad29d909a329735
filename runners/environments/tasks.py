"""Celery tasks of environments: take ids, reload, call a service.

Each task has an explicit, stable name (the module path it had before the apps were split):
renaming one strands the messages queued under the old name, so tests/test_task_names.py lists
them all.
"""

from celery import shared_task
from celery.exceptions import MaxRetriesExceededError
from django.conf import settings

from common.dispatch import retry_or_give_up
from runners.backends.base import TransientBackendError
from runners.environments import services as environments
from runners.environments.models import EnvironmentState

ENVIRONMENT_MAX_RETRIES = 8


@shared_task(name="runners.tasks.environment_provision", bind=True, acks_late=True, max_retries=ENVIRONMENT_MAX_RETRIES)
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
    name="runners.tasks.environment_teardown",
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
    name="runners.tasks.environment_sync",
    bind=True,
    acks_late=True,
    autoretry_for=(TransientBackendError,),
    retry_backoff=2,
    retry_backoff_max=120,
    max_retries=ENVIRONMENT_MAX_RETRIES,
)
def environment_sync(self, environment_id: int) -> bool:
    return environments.environment_sync_run(environment_id=environment_id)


@shared_task(name="runners.tasks.environment_sweep")
def environment_sweep() -> dict[str, list[int]]:
    return environments.environment_sweep_run(stuck_after_s=settings.STUCK_AFTER_S)


@shared_task(
    name="runners.tasks.environment_access_revoke",
    bind=True,
    acks_late=True,
    autoretry_for=(TransientBackendError,),
    retry_backoff=2,
    retry_backoff_max=120,
    max_retries=ENVIRONMENT_MAX_RETRIES,  # past that, the next re-sync's prune still removes the access
)
def environment_access_revoke(self, tenant_id: int, username: str) -> list[int]:
    return environments.environment_access_revoke_run(tenant_id=tenant_id, username=username)
