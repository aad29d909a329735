"""Reads of quota data."""

from tenants.models import Tenant


def environment_quota_hard(*, tenant: Tenant) -> dict[str, int]:
    """ResourceQuota limits for every environment of a tenant.

    Until quotas are configured for a tenant, it is granted no GPUs at all:
    backends treat an absent resource as zero.
    """
    return {}
