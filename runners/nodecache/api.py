"""REST API of the node caches: each node's cache figures, staff only (anyone else lists nothing and gets 404)."""

import hmac

from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, viewsets
from rest_framework.authentication import BaseAuthentication
from rest_framework.decorators import action
from rest_framework.permissions import BasePermission
from rest_framework.response import Response

from quotas.api import StaffWritesOnly
from runners.clusters.models import Node
from runners.clusters.selectors import is_inventory_reader
from runners.nodecache import selectors, services
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


CACHE_AGENT = "cache-agent"


class CacheAgentAuthentication(BaseAuthentication):
    """A node's cache agent: ``Authorization: Bearer <CACHE_AGENT_TOKEN>`` (the Secret portal-cache-agent).
    Nobody is one while the portal has no token set; a wrong token is a 401, like no token."""

    def authenticate(self, request):
        token = getattr(settings, "CACHE_AGENT_TOKEN", "")
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if token and scheme == "Bearer" and hmac.compare_digest(given.encode(), token.encode()):
            return AnonymousUser(), CACHE_AGENT
        return None

    def authenticate_header(self, request):
        return "Bearer"


class CacheAgentScheme(OpenApiAuthenticationExtension):
    target_class = "runners.nodecache.api.CacheAgentAuthentication"
    name = "cacheAgentToken"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "The node cache agents' token (CACHE_AGENT_TOKEN)."}


class IsCacheAgent(BasePermission):
    message = "Only a node's cache agent reports its cache."

    def has_permission(self, request, view):
        return request.auth == CACHE_AGENT


class CacheStatsSerializer(serializers.Serializer):
    capacity_bytes = serializers.IntegerField(min_value=0)
    bytes_held = serializers.IntegerField(min_value=0)
    blobs = serializers.IntegerField(min_value=0)
    pinned_bytes = serializers.IntegerField(min_value=0)
    hits = serializers.IntegerField(min_value=0)
    misses = serializers.IntegerField(min_value=0)
    bytes_pulled = serializers.IntegerField(min_value=0)
    evictions = serializers.IntegerField(min_value=0)
    bytes_evicted = serializers.IntegerField(min_value=0)


class CacheEntrySerializer(serializers.Serializer):
    sha256 = serializers.RegexField(r"^[0-9a-f]{64}$")
    kind = serializers.CharField(max_length=16)
    bytes = serializers.IntegerField(min_value=0)
    state = serializers.CharField(max_length=16)
    filled_at = serializers.FloatField()
    last_used = serializers.FloatField()
    pins = serializers.ListField(child=serializers.CharField(max_length=128))


class CacheSnapshotSerializer(serializers.Serializer):
    stats = CacheStatsSerializer()
    entries = CacheEntrySerializer(many=True)


class CacheReportSerializer(serializers.Serializer):
    node = serializers.CharField(max_length=253)
    snapshot = CacheSnapshotSerializer()

    def validate_node(self, value):
        if not Node.objects.filter(name=value).exists():
            raise serializers.ValidationError(f"No node {value!r} in the portal's inventory.")
        return value


class CacheReportResultSerializer(serializers.Serializer):
    node = serializers.CharField()
    added = serializers.IntegerField()
    removed = serializers.IntegerField()


class NodeCacheViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Each node's cache of dataset shards and model weights, as last synced: staff only."""

    serializer_class = NodeCacheStateSerializer
    lookup_value_regex = r"[0-9]+"
    permission_classes = [StaffWritesOnly]

    def get_queryset(self):
        if not is_inventory_reader(self.request.user):
            return NodeCacheState.objects.none()
        return selectors.node_cache_states(user=self.request.user)

    @extend_schema(request=CacheReportSerializer, responses=CacheReportResultSerializer)
    @action(detail=False, methods=["post"], url_path="report", authentication_classes=[CacheAgentAuthentication],
            permission_classes=[IsCacheAgent])
    def report(self, request):
        """A Kubernetes node's cache agent reports what its cache holds (runners.workloads.cache_agent): the
        node's rows are brought to it. Only the agents' token is accepted."""
        given = CacheReportSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        return Response(services.node_cache_report(node_name=given.validated_data["node"],
                                                   snapshot=given.validated_data["snapshot"]))
