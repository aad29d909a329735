"""Environments' subscriptions to what the apps below announce (connected in EnvironmentsConfig.ready()).

tenants and quotas never import runners; when something changes there that an environment copies
(its members, its quota), they send a signal and these receivers resync the tenant's environments.
"""

from django.dispatch import receiver

from quotas.signals import quota_changed
from runners.environments.services import environments_access_revoke, environments_resync
from tenants.signals import member_removed, members_changed


@receiver(members_changed, dispatch_uid="runners-resync-on-members")
def _members_changed(sender, *, tenant, **kwargs) -> None:
    environments_resync(tenant)


@receiver(quota_changed, dispatch_uid="runners-resync-on-quota")
def _quota_changed(sender, *, tenant, **kwargs) -> None:
    environments_resync(tenant)


@receiver(member_removed, dispatch_uid="runners-revoke-on-member-removed")
def _member_removed(sender, *, tenant, username, **kwargs) -> None:
    environments_access_revoke(tenant=tenant, username=username)
