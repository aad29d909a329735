"""What each node's cache holds: one row per (node, blob) the cache agent has filled and not evicted.

The cache itself lies on the node (a folder per node pool's `cache_path`, local NVMe in production) and
is kept by `runners.storage.nodecache`; these rows are the portal's view of it, written when a fill is
done and removed when an eviction is, so that the scheduler can prefer nodes that already hold a job's
bytes and the cockpit can show bytes per node and the hit rate. Blobs are keyed by content (sha256),
so a shard two tenants' datasets share is cached once; who may read it is still checked per dataset.
"""

from django.db import models


class BlobKind(models.TextChoices):
    SHARD = "shards", "dataset shard"
    MODEL = "models", "model weights"
    CHUNK = "chunks", "checkpoint chunk"


class CachedBlob(models.Model):
    node = models.ForeignKey("clusters.Node", on_delete=models.CASCADE, related_name="cached_blobs")
    kind = models.CharField(max_length=10, choices=BlobKind.choices)
    sha256 = models.CharField(max_length=64)
    bytes = models.BigIntegerField()
    filled_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "sha256"], name="one_cached_blob_per_node")]
        indexes = [models.Index(fields=["sha256"], name="cached_blob_by_sha")]

    def __str__(self) -> str:
        return f"{self.node_id}:{self.kind}/{self.sha256[:12]}"
