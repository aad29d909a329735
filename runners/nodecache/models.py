"""What each node's cache holds: one row per (node, blob) the cache agent has filled and not evicted.

The cache itself lies on the node (a folder per node pool's `cache_path`, local NVMe in production) and
is kept by `runners.storage.nodecache`; these rows are the portal's view of it, written when a fill is
done and removed when an eviction is, so that the scheduler can prefer nodes that already hold a job's
bytes and the cockpit can show bytes per node and the hit rate. Blobs are keyed by content (sha256),
so a shard two tenants' datasets share is cached once; who may read it is still checked per dataset.
"""

from django.db import models
from django.utils import timezone


class BlobKind(models.TextChoices):
    SHARD = "shards", "dataset shard"
    MODEL = "models", "model weights"
    CHUNK = "chunks", "checkpoint chunk"


class CachedBlob(models.Model):
    node = models.ForeignKey("clusters.Node", on_delete=models.CASCADE, related_name="cached_blobs")
    kind = models.CharField(max_length=10, choices=BlobKind.choices)
    sha256 = models.CharField(max_length=64)
    bytes = models.BigIntegerField()
    # As the cache recorded them (the sync copies its times), not when the portal learned of them.
    filled_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "sha256"], name="one_cached_blob_per_node")]
        indexes = [models.Index(fields=["sha256"], name="cached_blob_by_sha")]

    def __str__(self) -> str:
        return f"{self.node_id}:{self.kind}/{self.sha256[:12]}"


class NodeCacheState(models.Model):
    """One node's cache as last read: its capacity, the bytes it holds and its counters (since the cache was
    made: hits, misses, bytes pulled from the store, evictions). What the cockpit and ``/metrics`` show."""

    node = models.OneToOneField("clusters.Node", on_delete=models.CASCADE, related_name="cache_state")
    capacity_bytes = models.BigIntegerField(default=0)
    bytes_held = models.BigIntegerField(default=0)
    pinned_bytes = models.BigIntegerField(default=0)
    blobs = models.IntegerField(default=0)
    hits = models.BigIntegerField(default=0)
    misses = models.BigIntegerField(default=0)
    bytes_pulled = models.BigIntegerField(default=0)
    evictions = models.BigIntegerField(default=0)
    synced_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"cache of node {self.node_id}"

    @property
    def hit_rate(self) -> float | None:
        asked = self.hits + self.misses
        return None if asked == 0 else self.hits / asked
