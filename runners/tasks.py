"""Celery tasks for the inventory and partition changes."""

from celery import shared_task
from django.conf import settings

from portal.tasks import retry_or_give_up
from runners import services
from runners.backends.base import TransientBackendError

PARTITION_MAX_RETRIES = 10


@shared_task(bind=True, acks_late=True, max_retries=PARTITION_MAX_RETRIES)
def partition_apply(self, change_id: int) -> str:
    try:
        return services.partition_change_run(change_id=change_id)
    except TransientBackendError as exc:
        return retry_or_give_up(
            self,
            exc,
            give_up=lambda reason: services.partition_change_give_up(change_id=change_id, reason=reason),
            before_retry=lambda reason: services.partition_change_release(change_id=change_id),
            cap_s=60,
        )


@shared_task
def partition_change_sweep() -> list[int]:
    return services.partition_change_sweep(stuck_after_s=settings.STUCK_AFTER_S)


@shared_task(autoretry_for=(TransientBackendError,), retry_backoff=5, max_retries=3)
def inventory_sync() -> dict[str, int]:
    counts = services.inventory_sync()
    counts["flavors_created"] = len(services.flavors_discover())
    return counts
