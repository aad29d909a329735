"""Reads of the inventory (node pools, nodes, GPUs) and of partition changes. Staff only.

The inventory is the operator's view of the cluster, not tenant data, so every read
here refuses anyone but staff with a 404: the pages and their fragments cannot forget it.
"""

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Count, Prefetch, QuerySet
from django.http import Http404

from quotas.models import PartitionChange, PartitionProfile
from runners.models import Gpu, Node, NodePool


def _require_staff(user: AbstractBaseUser) -> None:
    if not (user.is_authenticated and user.is_staff):
        raise Http404("No such page.")


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
        raise Http404("No such node pool.") from None


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
