"""Celery tasks of the inventory and partition changes: take ids, reload, call a service.

Each task has an explicit, stable name (the module path it had before the apps were split):
renaming one strands the messages queued under the old name, so tests/test_task_names.py lists
them all.
"""

from celery import shared_task
from django.conf import settings

from common.dispatch import retry_or_give_up, send_task
from runners.backends.base import TransientBackendError
from runners.clusters import services as clusters

PARTITION_MAX_RETRIES = 10


@shared_task(name="runners.tasks.partition_apply", bind=True, acks_late=True, max_retries=PARTITION_MAX_RETRIES)
def partition_apply(self, change_id: int, lease: str | None = None) -> str:
    """One step of a partition change, then the next step is sent with a countdown: no worker waits."""
    try:
        state, delay_s, next_lease = clusters.partition_change_step(change_id=change_id, lease=lease)
    except TransientBackendError as exc:
        return retry_or_give_up(
            self,
            exc,
            give_up=lambda reason: clusters.partition_change_give_up(change_id=change_id, reason=reason),
            before_retry=lambda reason: clusters.partition_change_release(change_id=change_id),
            cap_s=60,
        )
    if delay_s is not None:
        # Lost (the broker is down): the change's lease runs out and the sweep sends it again.
        send_task("runners.tasks.partition_apply", change_id, next_lease, countdown=delay_s)
    return state


@shared_task(name="runners.tasks.partition_change_sweep")
def partition_change_sweep() -> list[int]:
    return clusters.partition_change_sweep(stuck_after_s=settings.STUCK_AFTER_S)


@shared_task(name="runners.tasks.inventory_sync", autoretry_for=(TransientBackendError,), retry_backoff=5, max_retries=3)
def inventory_sync() -> dict[str, int]:
    counts = clusters.inventory_sync()
    counts["flavors_created"] = len(clusters.flavors_discover())
    return counts
