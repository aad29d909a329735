"""Reads of the inventory and partition changes: the operator's view of the cluster.

Pools, nodes, GPUs and partition changes are staff's, and every read of them here refuses anyone
else with NotFound, so the pages, their fragments and the API cannot forget it. What a tenant may
know of the cluster is each flavor's capacity, which names no node and no other tenant
(``ResourceFlavor.capacity``, on /api/v1/flavors/).
"""


from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Count, Prefetch, QuerySet

from common.errors import NotFound
from runners.backends.base import NodeCacheSpec
from runners.clusters.models import Gpu, Node, NodePool, PartitionChange, PartitionProfile
from runners.nvidia import gpu_operator


def is_inventory_reader(user: AbstractBaseUser) -> bool:
    """Who may see pools, nodes, GPUs and partition changes: staff."""
    return bool(user.is_authenticated and user.is_staff)


def _require_staff(user: AbstractBaseUser) -> None:
    if not is_inventory_reader(user):
        raise NotFound("No such page.")


def node_pool_list(*, user: AbstractBaseUser) -> QuerySet[NodePool]:
    """Every node pool with its profile and how many nodes and GPUs it has."""
    _require_staff(user)
    return (
        NodePool.objects.select_related("partition_profile")
        .annotate(node_count=Count("nodes", distinct=True), gpu_count=Count("nodes__gpus", distinct=True))
        .order_by("name")
    )


def node_pool_get(*, user: AbstractBaseUser, pool_id: int) -> NodePool:
    try:
        return node_pool_list(user=user).get(id=pool_id)
    except (NodePool.DoesNotExist, ValueError):
        raise NotFound("No such node pool.") from None


def node_pool_nodes(*, user: AbstractBaseUser, pool: NodePool) -> QuerySet[Node]:
    """The pool's nodes, each with its GPUs in index order."""
    _require_staff(user)
    return pool.nodes.order_by("name").prefetch_related(Prefetch("gpus", queryset=Gpu.objects.order_by("index")))


def node_pool_profiles(*, user: AbstractBaseUser, pool: NodePool) -> QuerySet[PartitionProfile]:
    """Profiles that can be applied to the pool: those for its GPU model."""
    _require_staff(user)
    profiles = PartitionProfile.objects.order_by("name")
    return profiles.filter(gpu_model=pool.gpu_model) if pool.gpu_model else profiles


def partition_change_latest(*, user: AbstractBaseUser, pool: NodePool) -> PartitionChange | None:
    _require_staff(user)
    return pool.partition_changes.select_related("profile", "created_by").order_by("-created_at", "-id").first()


def partition_change_latest_by_pool(*, user: AbstractBaseUser) -> dict[int, PartitionChange]:
    """The newest change of every pool that had one, by pool id."""
    _require_staff(user)
    latest: dict[int, PartitionChange] = {}
    for change in PartitionChange.objects.select_related("profile").order_by("pool_id", "-created_at", "-id"):
        latest.setdefault(change.pool_id, change)
    return latest


def node_pool_first_gpus(*, user: AbstractBaseUser) -> dict[int, Gpu]:
    """The first GPU (by node name, then index) of every pool that has one, by pool id."""
    _require_staff(user)
    first: dict[int, Gpu] = {}
    for gpu in Gpu.objects.filter(node__pool__isnull=False).select_related("node").order_by("node__pool_id", "node__name", "index"):
        first.setdefault(gpu.node.pool_id, gpu)
    return first


# The API lists below are empty for anyone but staff, so a list says nothing and an id is a 404.


def node_list(*, user: AbstractBaseUser) -> QuerySet[Node]:
    """Every node with its pool and GPUs (staff; nothing for anyone else)."""
    nodes = Node.objects.select_related("pool").prefetch_related(Prefetch("gpus", queryset=Gpu.objects.order_by("index")))
    return nodes.order_by("name") if is_inventory_reader(user) else nodes.none()


def node_pool_api_list(*, user: AbstractBaseUser) -> QuerySet[NodePool]:
    """Node pools with their nodes (staff; nothing for anyone else)."""
    pools = NodePool.objects.prefetch_related("nodes").select_related("partition_profile").order_by("name")
    return pools if is_inventory_reader(user) else pools.none()


def partition_change_list(*, user: AbstractBaseUser) -> QuerySet[PartitionChange]:
    """Partition changes, newest first (staff; nothing for anyone else: their steps name every tenant's work)."""
    changes = PartitionChange.objects.select_related("pool", "profile").order_by("-created_at", "-id")
    return changes if is_inventory_reader(user) else changes.none()


# --- Partition profiles: a public catalog of shapes, applied by staff ---------------


def partition_profile_configs(profile: PartitionProfile) -> dict:
    """The NVIDIA GPU Operator configuration that applying the profile amounts to.

    The same rendering the Kubernetes backend applies to each node
    (`gpu_operator.node_partition_request`); a label shown as None is removed.
    """
    request = gpu_operator.node_partition_request(
        name=profile.name, kind=profile.kind, gpu_model_name=profile.gpu_model, layout=profile.layout,
        replicas=profile.replicas,
    )
    return {
        "node_labels": dict(request.node_labels),
        "mig_parted_config": request.mig_parted_config_text(),
        "device_plugin_config": request.device_plugin_config,
    }



def partition_profile_list() -> QuerySet[PartitionProfile]:
    return PartitionProfile.objects.prefetch_related("node_pools").order_by("gpu_model", "name")


def node_cache_specs(node_names) -> tuple[NodeCacheSpec, ...]:
    """The caches of these nodes as their pools set them, for the launch the portal builds (no user's read:
    nothing of it reaches a tenant but its own attempt's cache). A pool that sets neither path nor size is
    left out: the backend's defaults hold there."""
    rows = Node.objects.filter(name__in=set(node_names), pool__isnull=False).values_list(
        "name", "pool__cache_path", "pool__cache_bytes")
    return tuple(
        NodeCacheSpec(node=name, path=path, capacity_bytes=size)
        for name, path, size in sorted(rows) if path or size
    )
