"""The usage app's answers to the signals of the apps it meters (connected in UsageConfig.ready())."""

from django.db import transaction
from django.dispatch import receiver

from common.dispatch import send_task
from runners.clusters.signals import capacity_changed
from runners.jobs.signals import attempts_ended
from runners.usage.models import CapacityChange


@receiver(attempts_ended, dispatch_uid="usage-settles-ended-attempts")
def _attempts_ended(sender, *, job_ids, **kwargs) -> None:
    # Settled by a worker after the end commits; the settle sweep catches a message that was lost.
    job_ids = list(job_ids)
    transaction.on_commit(lambda: send_task("runners.tasks.usage_settle", job_ids))


@receiver(capacity_changed, dispatch_uid="usage-keeps-capacity-history")
def _capacity_changed(sender, *, capacities, at, **kwargs) -> None:
    CapacityChange.objects.bulk_create(
        [CapacityChange(flavor_id=flavor_id, capacity=capacity, at=at) for flavor_id, capacity in capacities.items()]
    )
