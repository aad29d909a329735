"""Celery tasks for the inventory and partition changes."""

from celery import shared_task

from runners import services
from runners.backends.base import TransientBackendError


PARTITION_MAX_RETRIES = 10


@shared_task(bind=True, acks_late=True, max_retries=PARTITION_MAX_RETRIES)
def partition_apply(self, change_id: int) -> str:
    try:
        return services.partition_change_run(change_id=change_id)
    except TransientBackendError as exc:
        if self.request.retries >= self.max_retries:
            services.partition_change_give_up(change_id=change_id, reason=str(exc))
            return "failed"
        services.partition_change_release(change_id=change_id)
        raise self.retry(exc=exc, countdown=min(2 ** (self.request.retries + 1), 60)) from None


@shared_task
def partition_change_sweep() -> list[int]:
    from django.conf import settings

    return services.partition_change_sweep(stuck_after_s=settings.STUCK_AFTER_S)


@shared_task(autoretry_for=(TransientBackendError,), retry_backoff=5, max_retries=3)
def inventory_sync() -> dict[str, int]:
    return services.inventory_sync()
