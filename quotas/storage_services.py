"""Writes of a tenant's checkpoint storage settings (quotas.TenantStorage): its quota, set by staff, and its
retention policy, set by the tenant's admins and owners (staff act as owners). Every change is audited in
its own transaction, as quota changes are."""

from __future__ import annotations

from decimal import Decimal

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from audit.services import record
from common.errors import Invalid, NotAllowed
from quotas.models import TenantStorage
from runners.storage import retention
from tenants.models import Role, Tenant
from tenants.selectors import tenant_get, user_has_role

# Left out of a change: the setting keeps its value.
UNCHANGED = object()
QUOTA_GB_MAX = Decimal("999999999.999")  # what the column holds (12 digits, 3 after the point)


def retention_parse(data, field: str = "retention") -> retention.RetentionPolicy:
    """A retention policy from its JSON form; Invalid naming the field (``retention.keep_newest``)."""
    try:
        return retention.parse_policy(data, field=field)
    except ValueError as exc:
        name, _, message = str(exc).partition(": ")
        raise Invalid(name, message) from None


def _snapshot(storage: TenantStorage | None) -> dict:
    if storage is None:
        return {"quota_gb": None, "retention": None}
    return {"quota_gb": None if storage.quota_gb is None else str(storage.quota_gb), "retention": storage.retention}


@transaction.atomic
def tenant_storage_set(*, actor: AbstractBaseUser, tenant: Tenant, quota_gb=UNCHANGED,
                       retention_policy=UNCHANGED) -> TenantStorage:
    """Change a tenant's storage quota (GB of 10^9 bytes after deduplication; None: no limit; staff only)
    and/or its retention policy (its JSON form; None keeps everything; the tenant's admins and owners)."""
    tenant_get(user=actor, slug=tenant.slug)  # another tenant's is a 404
    if quota_gb is not UNCHANGED:
        if not actor.is_staff:
            raise NotAllowed("Only staff can change a tenant's storage quota.")
        if quota_gb is not None:
            try:
                quota_gb = Decimal(str(quota_gb))
            except ArithmeticError:
                raise Invalid("quota_gb", "A number of GB (10^9 bytes), or null for no limit.") from None
            if not quota_gb.is_finite() or quota_gb < 0 or quota_gb > QUOTA_GB_MAX:
                raise Invalid("quota_gb", f"A number of GB from 0 to {QUOTA_GB_MAX}, or null for no limit.")
            quota_gb = quota_gb.quantize(Decimal("0.001"))
    if retention_policy is not UNCHANGED:
        if not user_has_role(user=actor, tenant=tenant, at_least=Role.ADMIN):
            raise NotAllowed("Only the tenant's admins and owners can change its retention policy.")
        if retention_policy is not None:
            retention_policy = retention_parse(retention_policy).to_json()
    storage = TenantStorage.objects.select_for_update().filter(tenant=tenant).first()
    before = _snapshot(storage)
    storage = storage or TenantStorage(tenant=tenant)
    if quota_gb is not UNCHANGED:
        storage.quota_gb = quota_gb
    if retention_policy is not UNCHANGED:
        storage.retention = retention_policy
    after = _snapshot(storage)
    if after != before or storage.pk is None:
        storage.save()
        record("storage.updated", actor=actor, tenant=tenant, obj=storage, object_repr=f"{tenant.slug}: storage",
               before=before, after=after)
    return storage
