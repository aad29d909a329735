"""Reads of the audit log, always scoped to who asks: staff read every entry; a tenant's owners and
admins read their tenant's entries; nobody else reads any."""

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet

from audit.models import AuditEntry
from tenants.models import Membership, Role, Tenant

READER_ROLES = [Role.OWNER, Role.ADMIN]


def readable_tenant_ids(*, user: AbstractBaseUser) -> QuerySet:
    """The ids of the tenants whose entries the user may read (not used for staff, who read all)."""
    return Membership.objects.filter(user=user, role__in=READER_ROLES).values("tenant_id")


def can_read_audit(*, user: AbstractBaseUser) -> bool:
    """Whether the user may read any part of the audit log: staff, or an owner or admin of a tenant."""
    if not user.is_authenticated:
        return False
    return user.is_staff or readable_tenant_ids(user=user).exists()


def entry_list(*, user: AbstractBaseUser) -> QuerySet[AuditEntry]:
    """The entries the user may read, newest first. Entries of no tenant (flavors, prices, partitions,
    tokens) are staff's only."""
    if not user.is_authenticated:
        return AuditEntry.objects.none()
    entries = AuditEntry.objects.order_by("-at", "-id")
    if user.is_staff:
        return entries
    return entries.filter(tenant_id__in=readable_tenant_ids(user=user))


def reader_tenant_slugs(*, user: AbstractBaseUser) -> list[str]:
    """The slugs of the tenants whose log the user reads (for a filter's choices); staff: every tenant."""
    tenants = Tenant.objects.all() if user.is_staff else Tenant.objects.filter(id__in=readable_tenant_ids(user=user))
    return list(tenants.order_by("slug").values_list("slug", flat=True))
