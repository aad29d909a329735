"""Celery tasks for the inventory and partition changes."""

from celery import shared_task

from runners import services
from runners.backends.base import TransientBackendError


@shared_task(
    bind=True, acks_late=True, autoretry_for=(TransientBackendError,), retry_backoff=2, retry_backoff_max=60, max_retries=10
)
def partition_apply(self, change_id: int) -> str:
    return services.partition_change_run(change_id=change_id)


@shared_task(autoretry_for=(TransientBackendError,), retry_backoff=5, max_retries=3)
def inventory_sync() -> dict[str, int]:
    return services.inventory_sync()
