"""Reads of flavors, quotas, partition profiles and what the inventory can hold."""

from collections import defaultdict
from decimal import Decimal

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet
from django.utils import timezone

from quotas.models import PriceCard, Quota, ResourceFlavor
from runners.backends.base import TIMESLICE_RESOURCE, WHOLE_GPU_RESOURCE
from runners.models import Gpu, PartitionKind
from runners.scheduler import mig
from tenants.models import Tenant
from tenants.selectors import tenant_list


def flavor_kubernetes_resource(flavor: ResourceFlavor) -> str:
    """The extended resource a pod requests for one unit of the flavor."""
    if flavor.kind == PartitionKind.MIG:
        return mig.kubernetes_resource_for(flavor.mig_profile)
    if flavor.kind == PartitionKind.TIMESLICE:
        return TIMESLICE_RESOURCE
    return WHOLE_GPU_RESOURCE


def flavor_node_labels(flavor: ResourceFlavor) -> dict[str, str]:
    """Node labels (as GPU feature discovery sets them) that pick nodes offering the flavor."""
    product = mig.gpu_model(flavor.gpu_model).product_label
    if flavor.kind == PartitionKind.TIMESLICE:
        # GFD appends -SHARED to the product of time-sliced GPUs.
        return {"nvidia.com/gpu.product": f"{product}-SHARED"}
    if flavor.kind == PartitionKind.MIG:
        return {"nvidia.com/gpu.product": product, "nvidia.com/mig.strategy": "mixed"}
    return {"nvidia.com/gpu.product": product}


def flavor_capacity(flavor: ResourceFlavor) -> int:
    """Units of the flavor the schedulable inventory holds under its current partitions."""
    gpus = Gpu.objects.filter(model=flavor.gpu_model, node__schedulable=True, partition_kind=flavor.kind)
    if flavor.kind == PartitionKind.WHOLE:
        return gpus.count()
    if flavor.kind == PartitionKind.TIMESLICE:
        return sum(gpus.values_list("timeslice_replicas", flat=True))
    return sum(
        1 for layout in gpus.values_list("mig_layout", flat=True) for profile, _start in layout
        if profile == flavor.mig_profile
    )


def flavor_price_now(flavor: ResourceFlavor, *, at=None) -> PriceCard | None:
    """The price card in force at a moment (now by default): the newest that has started."""
    return flavor.prices.filter(effective_from__lte=at or timezone.now()).order_by("-effective_from").first()


def quota_list(*, user: AbstractBaseUser, tenant: Tenant | None = None) -> QuerySet[Quota]:
    """Quotas of the user's tenants (all of them for staff)."""
    queryset = Quota.objects.filter(tenant__in=tenant_list(user=user)).select_related("tenant", "flavor")
    if tenant is not None:
        queryset = queryset.filter(tenant=tenant)
    return queryset


def guaranteed_total(flavor: ResourceFlavor, *, excluding_tenant: Tenant | None = None) -> int:
    queryset = Quota.objects.filter(flavor=flavor)
    if excluding_tenant is not None:
        queryset = queryset.exclude(tenant=excluding_tenant)
    return sum(queryset.values_list("guaranteed", flat=True))


def environment_quota_hard(*, tenant: Tenant) -> dict[str, int]:
    """ResourceQuota limits for every environment of a tenant: its burst ceiling per resource.

    A tenant with no quota for a resource is granted none of it: backends treat
    an absent resource as zero. Flavors of different models that share one
    extended resource (nvidia.com/gpu) add up, since Kubernetes quota cannot
    tell them apart; the scheduler enforces the per-model split.
    """
    hard: dict[str, int] = defaultdict(int)
    for quota in Quota.objects.filter(tenant=tenant).select_related("flavor"):
        hard[f"requests.{flavor_kubernetes_resource(quota.flavor)}"] += quota.max
    return dict(sorted(hard.items()))


def money(value: Decimal) -> str:
    return f"{value:.4f}"
