"""Reads of the node caches: which nodes hold which of a job's bytes (for placement), and each node's cache
figures (for the cockpit and ``/metrics``; staff only, like every read of the inventory)."""

from __future__ import annotations

from collections.abc import Iterable

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Sum

from common.errors import NotFound
from runners.clusters.selectors import is_inventory_reader
from runners.nodecache.models import CachedBlob, NodeCacheState


def bytes_held(node_names: Iterable[str], sha256s: Iterable[str]) -> dict[str, int]:
    """How many bytes of these blobs each of these nodes' caches holds (0 for a node holding none of them).

    No user's read: the scheduler's cycle asks it with a job's own blobs, and the answer names no blob."""
    names, shas = set(node_names), set(sha256s)
    held = dict.fromkeys(sorted(names), 0)
    if not names or not shas:
        return held
    rows = (
        CachedBlob.objects.filter(node__name__in=names, sha256__in=shas)
        .values_list("node__name").annotate(total=Sum("bytes"))
    )
    for name, total in rows:
        held[name] = int(total or 0)
    return held


def node_cache_states(*, user: AbstractBaseUser):
    """Every node's cache figures, by node name (staff only: the caches name every tenant's work)."""
    if not is_inventory_reader(user):
        raise NotFound("No node caches here.")
    return NodeCacheState.objects.select_related("node", "node__pool").order_by("node__name")


def cache_totals() -> dict:
    """The caches of every node together: bytes held and capacity, hits, misses, bytes pulled and the hit rate."""
    totals = NodeCacheState.objects.aggregate(
        bytes_held=Sum("bytes_held"), capacity_bytes=Sum("capacity_bytes"), hits=Sum("hits"), misses=Sum("misses"),
        bytes_pulled=Sum("bytes_pulled"),
    )
    totals = {key: int(value or 0) for key, value in totals.items()}
    asked = totals["hits"] + totals["misses"]
    totals["hit_rate"] = None if asked == 0 else totals["hits"] / asked
    totals["nodes"] = NodeCacheState.objects.count()
    return totals
