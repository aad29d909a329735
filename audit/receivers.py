"""The audit log hears the changes of the apps below it, which announce them (tenants imports no audit),
and grants the portal's role its rights after `migrate` (DATABASE_APP_ROLE)."""

from django.conf import settings
from django.db import connections
from django.db.models.signals import post_migrate
from django.dispatch import receiver

from audit.roles import grant_app_role
from audit.services import record
from tenants.signals import changed


@receiver(changed)
def record_tenants_change(sender, action: str, signal=None, **details) -> None:
    """An entry for a change to a tenant, a member or a token, in the change's own transaction."""
    record(action, **details)


@receiver(post_migrate)
def grant_the_portals_role(sender, using: str = "default", **kwargs) -> None:
    """After `migrate` (run as the owner), the portal's role gets what it needs on the tables that now exist."""
    if sender.name == "audit" and settings.DATABASE_APP_ROLE:
        with connections[using].cursor() as cursor:
            grant_app_role(cursor, settings.DATABASE_APP_ROLE)
