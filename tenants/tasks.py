"""Celery tasks for environments: take ids, reload, call a service."""

import logging

from celery import shared_task
from django.conf import settings

from portal.tasks import retry_or_give_up
from runners.backends.base import TransientBackendError
from tenants import services

logger = logging.getLogger(__name__)
MAX_RETRIES = 8


@shared_task(bind=True, acks_late=True, max_retries=MAX_RETRIES)
def environment_provision(self, environment_id: int) -> str:
    try:
        return services.environment_provision_run(environment_id=environment_id)
    except TransientBackendError as exc:
        return retry_or_give_up(
            self,
            exc,
            give_up=lambda reason: services.environment_provision_give_up(environment_id=environment_id, reason=reason),
            before_retry=lambda reason: services.environment_note_retry(environment_id=environment_id, reason=reason),
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
    return services.environment_teardown_run(environment_id=environment_id)


@shared_task(
    bind=True,
    acks_late=True,
    autoretry_for=(TransientBackendError,),
    retry_backoff=2,
    retry_backoff_max=120,
    max_retries=MAX_RETRIES,
)
def environment_sync(self, environment_id: int) -> bool:
    return services.environment_sync_run(environment_id=environment_id)


@shared_task
def environment_sweep() -> dict[str, list[int]]:
    return services.environment_sweep_run(stuck_after_s=settings.STUCK_AFTER_S)
