"""The usage app's answers to the signals of the apps it meters (connected in UsageConfig.ready())."""

from django.db import transaction
from django.db.models.signals import post_save
from django.dispatch import receiver
from prometheus_client.core import GaugeMetricFamily

from common.dispatch import send_task
from common.metrics import metrics_collect
from quotas.models import PriceCard
from runners.clusters.signals import capacity_changed
from runners.jobs.signals import attempts_ended
from runners.usage import ledger, sampling
from runners.usage.models import CapacityChange


@receiver(attempts_ended, dispatch_uid="usage-settles-ended-attempts")
def _attempts_ended(sender, *, job_ids, **kwargs) -> None:
    # Settled by a worker after the end commits; the settle sweep catches a message that was lost.
    job_ids = list(job_ids)
    transaction.on_commit(lambda: send_task("runners.tasks.usage_settle", job_ids))


@receiver(post_save, sender=PriceCard, dispatch_uid="usage-reprices-on-a-new-price-card")
def _price_card_saved(sender, *, instance, **kwargs) -> None:
    # A card that starts in the past changes what was counted since: the sweep counts it again.
    ledger.reprice_from(instance.flavor_id, instance.effective_from)


@receiver(capacity_changed, dispatch_uid="usage-keeps-capacity-history")
def _capacity_changed(sender, *, capacities, at, **kwargs) -> None:
    CapacityChange.objects.bulk_create(
        [CapacityChange(flavor_id=flavor_id, capacity=capacity, at=at) for flavor_id, capacity in capacities.items()]
    )


@receiver(metrics_collect, dispatch_uid="usage-idle-gpus")
def _idle_gpus(sender, **kwargs) -> list[GaugeMetricFamily]:
    """GPU units held by allocations idle for the whole idle window (USAGE_IDLE_*), by tenant and flavor."""
    family = GaugeMetricFamily(
        "portal_gpu_units_idle", "GPU units held by allocations under the idle threshold for the whole idle window.",
        labels=["tenant", "flavor"],
    )
    totals: dict[tuple[str, str], int] = {}
    for item in sampling.idle_allocations():
        key = (item.job.tenant.slug, item.job.flavor.name)
        totals[key] = totals.get(key, 0) + item.units
    for (tenant, flavor), units in sorted(totals.items()):
        family.add_metric([tenant, flavor], units)
    return [family]
