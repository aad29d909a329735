"""REST API of the node caches: each node's cache figures, staff only (anyone else lists nothing and gets 404)."""

from rest_framework import mixins, serializers, viewsets

from quotas.api import StaffWritesOnly
from runners.clusters.selectors import is_inventory_reader
from runners.nodecache import selectors
from runners.nodecache.models import NodeCacheState


class NodeCacheStateSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.name", read_only=True)
    hit_rate = serializers.FloatField(read_only=True, allow_null=True,
                                      help_text="hits / (hits + misses); null before anything was asked of it.")

    class Meta:
        model = NodeCacheState
        fields = ["id", "node", "capacity_bytes", "bytes_held", "pinned_bytes", "blobs", "hits", "misses",
                  "hit_rate", "bytes_pulled", "evictions", "synced_at"]
        read_only_fields = fields


class NodeCacheViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Each node's cache of dataset shards and model weights, as last synced: staff only."""

    serializer_class = NodeCacheStateSerializer
    lookup_value_regex = r"[0-9]+"
    permission_classes = [StaffWritesOnly]

    def get_queryset(self):
        if not is_inventory_reader(self.request.user):
            return NodeCacheState.objects.none()
        return selectors.node_cache_states(user=self.request.user)
