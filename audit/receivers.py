"""The audit log hears the changes of the apps below it, which announce them (tenants imports no audit)."""

from django.dispatch import receiver

from audit.services import record
from tenants.signals import changed


@receiver(changed)
def record_tenants_change(sender, action: str, signal=None, **details) -> None:
    """An entry for a change to a tenant, a member or a token, in the change's own transaction."""
    record(action, **details)
