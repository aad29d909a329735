"""Reads of flavors, prices and quotas; a flavor's capacity is what runners last wrote on it."""

from collections import defaultdict

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet
from django.utils import timezone

from quotas.models import PartitionKind, PriceCard, Quota, ResourceFlavor
from runners.nvidia import catalog, names
from tenants.models import Tenant
from tenants.selectors import tenant_list


def flavor_spec(flavor: ResourceFlavor) -> catalog.FlavorSpec:
    """What the flavor means on a cluster, from the GPU catalog."""
    if flavor.kind == PartitionKind.MIG:
        return catalog.mig_flavor(flavor.gpu_model, flavor.mig_profile)
    if flavor.kind == PartitionKind.TIMESLICE:
        # The portal's time-slicing configs rename shared replicas (renameByDefault), so the
        # resource is names.TIMESLICE_RESOURCE whatever the replica count; 2 is the smallest share.
        return catalog.time_sliced_flavor(flavor.gpu_model, 2, rename_by_default=True)
    return catalog.whole_gpu_flavor(flavor.gpu_model)


def flavor_kubernetes_resource(flavor: ResourceFlavor) -> str:
    """The extended resource a pod requests for one unit of the flavor."""
    return flavor_spec(flavor).kubernetes_resource


def flavor_node_labels(flavor: ResourceFlavor) -> dict[str, str]:
    """Node labels (as GPU feature discovery sets them) that pick nodes offering the flavor."""
    labels = dict(flavor_spec(flavor).node_labels)
    # The replica count belongs to a pool's profile, not to the flavor.
    labels.pop(names.GPU_REPLICAS_LABEL, None)
    return labels


def flavor_price_now(flavor: ResourceFlavor, *, at=None) -> PriceCard | None:
    """The price card in force at a moment (now by default): the newest that has started."""
    return flavor.prices.filter(effective_from__lte=at or timezone.now()).order_by("-effective_from").first()


def quota_list(*, user: AbstractBaseUser, tenant: Tenant | None = None) -> QuerySet[Quota]:
    """Quotas of the user's tenants (all of them for staff)."""
    queryset = Quota.objects.filter(tenant__in=tenant_list(user=user)).select_related("tenant", "flavor")
    if tenant is not None:
        queryset = queryset.filter(tenant=tenant)
    return queryset


def tenant_quota_row(quota: Quota) -> dict:
    """One row of a tenant's quota page: its quota, the price, and whether capacity backs the guarantee.

    Capacity is the inventory as it is now. A guarantee is backed when all the
    flavor's guarantees together fit in it; otherwise the tenant is told how
    much of its own the cluster could honour in proportion.
    """
    capacity = quota.flavor.capacity
    total = guaranteed_total(quota.flavor)
    backed = quota.guaranteed if total <= capacity else quota.guaranteed * capacity // total
    return {
        "quota": quota,
        "price": flavor_price_now(quota.flavor),
        "capacity": capacity,
        "backed": backed,
        "unbacked": quota.guaranteed - backed,
    }


def guaranteed_total(flavor: ResourceFlavor, *, excluding_tenant: Tenant | None = None) -> int:
    queryset = Quota.objects.filter(flavor=flavor)
    if excluding_tenant is not None:
        queryset = queryset.exclude(tenant=excluding_tenant)
    return sum(queryset.values_list("guaranteed", flat=True))


def environment_quota_hard(*, tenant: Tenant) -> dict[str, int]:
    """ResourceQuota limits for every environment of a tenant: its burst ceiling per resource.

    A tenant with no quota for a resource is granted none of it: backends treat
    an absent resource as zero. Flavors of different models that share one
    extended resource (names.GPU_RESOURCE) add up, since Kubernetes quota cannot
    tell them apart; the scheduler enforces the per-model split.
    """
    hard: dict[str, int] = defaultdict(int)
    for quota in Quota.objects.filter(tenant=tenant).select_related("flavor"):
        hard[f"requests.{flavor_kubernetes_resource(quota.flavor)}"] += quota.max
    return dict(sorted(hard.items()))


# --- Reads for the admin pages ----------------------------------------------


def flavor_list() -> QuerySet[ResourceFlavor]:
    """Every flavor; flavors are a public catalog, what a tenant may use is its quota."""
    return ResourceFlavor.objects.order_by("gpu_model", "kind", "mig_profile", "name")


def quota_table(*, user: AbstractBaseUser) -> dict:
    """Tenants x flavors for the admin quota table: each cell the tenant's quota or None.

    Each flavor comes with its capacity, current price and the guarantees already
    handed out, so the table can show how much of the cluster is promised.
    """
    flavors = list(flavor_list())
    tenants = list(tenant_list(user=user).order_by("slug"))
    quotas = {(quota.tenant_id, quota.flavor_id): quota for quota in quota_list(user=user)}
    columns = []
    for flavor in flavors:
        capacity = flavor.capacity
        guaranteed = guaranteed_total(flavor)
        columns.append(
            {
                "flavor": flavor,
                "capacity": capacity,
                "price": flavor_price_now(flavor),
                "guaranteed_total": guaranteed,
                "over_capacity": guaranteed > capacity,
            }
        )
    rows = [
        {"tenant": tenant, "cells": [{"flavor": flavor, "quota": quotas.get((tenant.id, flavor.id))} for flavor in flavors]}
        for tenant in tenants
    ]
    return {"columns": columns, "rows": rows}


def tenant_quotas(*, tenant: Tenant) -> QuerySet[Quota]:
    """The tenant's quotas with their flavors (for a page that already checked the caller may see the tenant)."""
    return Quota.objects.filter(tenant=tenant).select_related("flavor").order_by("flavor__name")
