"""Runners' subscriptions to what the apps below announce.

tenants and quotas never import runners; when something changes there that an
environment or a flavor's capacity copies, they send a signal and these
receivers do the work. Connected in RunnersConfig.ready().
"""

from django.db.models.signals import post_save
from django.dispatch import receiver

from quotas.models import ResourceFlavor
from quotas.signals import quota_changed
from tenants.signals import members_changed


@receiver(members_changed, dispatch_uid="runners-resync-on-members")
def _members_changed(sender, *, tenant, **kwargs) -> None:
    from runners.environments import environments_resync

    environments_resync(tenant)


@receiver(quota_changed, dispatch_uid="runners-resync-on-quota")
def _quota_changed(sender, *, tenant, **kwargs) -> None:
    from runners.environments import environments_resync

    environments_resync(tenant)


@receiver(post_save, sender=ResourceFlavor, dispatch_uid="runners-capacity-of-new-flavor")
def _flavor_created(sender, *, instance, created, raw=False, **kwargs) -> None:
    """A new flavor gets its capacity from the inventory at once, not at the next sync."""
    if created and not raw:
        from runners.services import flavor_capacity_refresh

        flavor_capacity_refresh()
