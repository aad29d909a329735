"""Writes of the node caches' rows: the portal's view of each node's cache, brought to what the cache holds.

The caches themselves are kept on the nodes (`runners.storage.nodecache`: the attempt's supervisor fills
them on the local backend, the cache agent on Kubernetes); ``caches_sync`` reads each one's snapshot
through the backend and makes the rows match: a ``CachedBlob`` per blob held (a fill adds one, an eviction
removes it, a use moves its ``last_used_at``), and a ``NodeCacheState`` with its counters. The sync is a
reconcile, not a stream of events: a lost message or a restart costs nothing but the time to the next one.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from django.db import transaction
from django.utils import timezone

from common.errors import NotFound
from runners.backends.base import NodeCacheSpec
from runners.clusters.models import Node
from runners.clusters.registry import get_backend
from runners.nodecache.models import BlobKind, CachedBlob, NodeCacheState
from runners.storage.nodecache import READY, CacheStats, Entry, Snapshot

logger = logging.getLogger(__name__)
KINDS = set(BlobKind.values)


def _when(seconds: float):
    return datetime.fromtimestamp(seconds, tz=UTC)


def caches_sync(*, backend=None) -> dict:
    """Read every node's cache through the backend and bring its rows to it; what changed, in counts.

    A backend that cannot read its nodes' caches (no ``node_cache_snapshots``) changes nothing."""
    backend = backend or get_backend()
    read = getattr(backend, "node_cache_snapshots", None)
    if read is None:
        return {"nodes": 0, "added": 0, "removed": 0}
    nodes = {node.name: node for node in Node.objects.select_related("pool")}
    specs = {
        name: NodeCacheSpec(name, node.pool.cache_path, node.pool.cache_bytes) if node.pool_id else None
        for name, node in nodes.items()
    }
    totals = {"nodes": 0, "added": 0, "removed": 0}
    for name, snapshot in read(specs).items():
        if name not in nodes:
            continue
        added, removed = node_cache_record(node=nodes[name], snapshot=snapshot)
        totals["nodes"] += 1
        totals["added"] += added
        totals["removed"] += removed
    return totals


def node_cache_record(*, node: Node, snapshot: Snapshot) -> tuple[int, int]:
    """Make the node's rows what its cache's snapshot says: (rows added, rows removed). Only blobs whose
    fill is done count as held (one being filled is not there for a placement to prefer yet)."""
    held = {entry.sha256: entry for entry in snapshot.entries if entry.state == READY and entry.kind in KINDS}
    with transaction.atomic():
        rows = {row.sha256: row for row in CachedBlob.objects.select_for_update().filter(node=node)}
        gone = [row.id for sha, row in rows.items() if sha not in held]
        CachedBlob.objects.filter(id__in=gone).delete()
        CachedBlob.objects.bulk_create([
            CachedBlob(node=node, kind=entry.kind, sha256=sha, bytes=entry.bytes, filled_at=_when(entry.filled_at),
                       last_used_at=_when(entry.last_used))
            for sha, entry in held.items() if sha not in rows
        ], ignore_conflicts=True)
        moved = []
        for sha, row in rows.items():
            entry = held.get(sha)
            if entry is not None and row.last_used_at != _when(entry.last_used):
                row.last_used_at = _when(entry.last_used)
                moved.append(row)
        CachedBlob.objects.bulk_update(moved, ["last_used_at"])
        stats = snapshot.stats
        NodeCacheState.objects.update_or_create(node=node, defaults=dict(
            capacity_bytes=stats.capacity_bytes, bytes_held=sum(entry.bytes for entry in held.values()),
            pinned_bytes=stats.pinned_bytes, blobs=len(held), hits=stats.hits, misses=stats.misses,
            bytes_pulled=stats.bytes_pulled, evictions=stats.evictions, synced_at=timezone.now(),
        ))
    return len([sha for sha in held if sha not in rows]), len(gone)


def node_cache_report(*, node_name: str, snapshot: dict) -> dict:
    """A Kubernetes node's cache agent reports its cache (`nodecache.snapshot_json`, already checked for shape):
    its rows brought to it, as the sync does on the local backend. NotFound for a node the portal does not know."""
    node = Node.objects.filter(name=node_name).first()
    if node is None:
        raise NotFound(f"No node {node_name!r} in the portal's inventory.")
    read = Snapshot(stats=CacheStats(**snapshot["stats"]),
                    entries=tuple(Entry(**{**entry, "pins": tuple(entry["pins"])}) for entry in snapshot["entries"]))
    added, removed = node_cache_record(node=node, snapshot=read)
    return {"node": node.name, "added": added, "removed": removed}
