"""The inventory's subscriptions to what the apps below announce (connected in ClustersConfig.ready())."""

from django.db.models.signals import post_save
from django.dispatch import receiver

from quotas.models import ResourceFlavor
from runners.clusters.services import flavor_capacity_refresh


@receiver(post_save, sender=ResourceFlavor, dispatch_uid="runners-capacity-of-new-flavor")
def _flavor_created(sender, *, instance, created, raw=False, **kwargs) -> None:
    """A new flavor gets its capacity from the inventory at once, not at the next sync."""
    if created and not raw:
        flavor_capacity_refresh()
