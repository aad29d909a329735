"""REST API for partition profiles, node pools, nodes and partition changes.

Pools, nodes and partition changes are staff's (anyone else gets 404, from runners.clusters.selectors);
the partition profiles are a public catalog. Tenants learn the cluster's capacity per flavor from
/api/v1/flavors/.
"""

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from common import nulls
from common.fields import StrictTypesMixin
from quotas.api import StaffWritesOnly
from quotas.models import PartitionKind
from runners.clusters import selectors as cluster_selectors
from runners.clusters import services as clusters
from runners.clusters.models import Gpu, Node, NodePool, PartitionChange, PartitionProfile

# --- Partition profiles -----------------------------------------------------


class PartitionProfileSerializer(serializers.ModelSerializer):
    gpu_operator = serializers.SerializerMethodField(
        help_text="Node labels, mig-parted config and device plugin config this profile applies."
    )

    class Meta:
        model = PartitionProfile
        fields = ["id", "name", "gpu_model", "kind", "layout", "replicas", "gpu_operator", "created_at"]

    def get_gpu_operator(self, profile) -> dict:
        return cluster_selectors.partition_profile_configs(profile)


class PartitionProfileWriteSerializer(StrictTypesMixin, serializers.Serializer):
    name = serializers.RegexField(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=63,
                                  error_messages={"invalid": "Use lowercase letters, digits, '-' and '.'; it becomes a node label value."})
    gpu_model = serializers.CharField(max_length=40)
    kind = serializers.ChoiceField(choices=PartitionKind.choices)
    layout = serializers.ListField(child=serializers.CharField(max_length=20), required=False, default=list, max_length=7)
    replicas = serializers.IntegerField(required=False, allow_null=True, default=None, min_value=1)


class PartitionProfileViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    queryset = PartitionProfile.objects.all()
    serializer_class = PartitionProfileSerializer
    lookup_value_regex = r"[0-9]+"
    permission_classes = [StaffWritesOnly]

    @extend_schema(request=PartitionProfileWriteSerializer, responses={201: PartitionProfileSerializer})
    def create(self, request):
        data = PartitionProfileWriteSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        profile = clusters.partition_profile_create(actor=request.user, **data.validated_data)
        return Response(PartitionProfileSerializer(profile).data, status=status.HTTP_201_CREATED)


# --- Inventory ----------------------------------------------------------------


class GpuSerializer(serializers.ModelSerializer):
    class Meta:
        model = Gpu
        fields = ["index", "model", "memory_mib", "uuid", "partition_kind", "mig_layout", "timeslice_replicas"]


class NodeSerializer(serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)  # a node outside any pool
    gpus = GpuSerializer(many=True, read_only=True)

    class Meta:
        model = Node
        fields = ["id", "name", "pool", "cpu_milli", "memory_mib", "rack", "block", "nvlink_domain", "schedulable",
                  "labels", "gpu_resources", "gpus", "source", "seen_at"]


class PartitionChangeSerializer(serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True)
    profile = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = PartitionChange
        fields = ["id", "pool", "profile", "drain", "state", "message", "steps", "created_at", "finished_at"]


class NodePoolSerializer(serializers.ModelSerializer):
    partition_profile = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)  # none applied yet
    nodes = serializers.SlugRelatedField(slug_field="name", many=True, read_only=True)
    latest_change = serializers.SerializerMethodField()

    class Meta:
        model = NodePool
        fields = ["id", "name", "gpu_model", "partition_profile", "nodes", "cache_path", "cache_bytes", "latest_change"]

    def get_latest_change(self, pool) -> dict | None:
        change = pool.partition_changes.order_by("-created_at", "-id").first()
        return PartitionChangeSerializer(change).data if change else None


class ApplySerializer(StrictTypesMixin, serializers.Serializer):
    profile = nulls.SlugRelatedField(slug_field="name", queryset=PartitionProfile.objects.all())
    drain = serializers.ChoiceField(choices=PartitionChange.Drain.choices, default=PartitionChange.Drain.WAIT)
    shrink_guarantees = serializers.BooleanField(
        default=False, help_text="Lower guarantees that would exceed the new capacity in proportion (recorded)."
    )


class CapacityChangeSerializer(serializers.Serializer):
    flavor = serializers.CharField()
    new_flavor = serializers.BooleanField(help_text="No flavor has this shape yet; discovery creates it, unpriced.")
    kind = serializers.CharField()
    gpu_model = serializers.CharField()
    mig_profile = serializers.CharField()
    capacity_before = serializers.IntegerField()
    capacity_after = serializers.IntegerField()
    guaranteed = serializers.IntegerField()
    unbacked = serializers.ListField(child=serializers.DictField(), help_text="Guarantees the new capacity cannot back.")


class NodePoolCacheSerializer(StrictTypesMixin, serializers.Serializer):
    cache_path = serializers.CharField(allow_blank=True, max_length=255, trim_whitespace=False,
                                       help_text="An absolute folder on the pool's nodes; blank for the backend's default.")
    cache_bytes = serializers.IntegerField(min_value=0, help_text="The most each node's cache holds; 0 for the default.")


class ApplyPreviewSerializer(serializers.Serializer):
    capacity = CapacityChangeSerializer(many=True)


class NodePoolViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Node pools, staff only (others list nothing and get 404): the operator's view of the cluster."""

    serializer_class = NodePoolSerializer
    lookup_value_regex = r"[0-9]+"
    permission_classes = [StaffWritesOnly]

    def get_queryset(self):
        return cluster_selectors.node_pool_api_list(user=self.request.user)

    @extend_schema(
        request=ApplySerializer,
        parameters=[OpenApiParameter("dry_run", bool, description="Only say what the apply would do to capacity.")],
        responses={202: PartitionChangeSerializer, 200: ApplyPreviewSerializer},
    )
    @action(detail=True, methods=["post"])
    def apply(self, request, pk):
        pool = self.get_object()
        dry_run = nulls.query_param(self.request, "dry_run") or "false"
        if dry_run not in ("true", "false"):
            raise serializers.ValidationError({"dry_run": "Use true or false."})
        data = ApplySerializer(data=request.data)
        data.is_valid(raise_exception=True)
        result = clusters.node_pool_apply(
            actor=request.user, pool=pool, dry_run=dry_run == "true", **data.validated_data
        )
        if result["change"] is None:
            return Response(ApplyPreviewSerializer(result).data)
        return Response(PartitionChangeSerializer(result["change"]).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=NodePoolCacheSerializer, responses={200: NodePoolSerializer})
    @action(detail=True, methods=["put"])
    def cache(self, request, pk):
        """Where each node of the pool keeps its cache of dataset shards and model weights, and its size."""
        pool = self.get_object()
        data = NodePoolCacheSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        pool = clusters.node_pool_cache_set(actor=request.user, pool=pool, **data.validated_data)
        return Response(NodePoolSerializer(pool).data)


class NodeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Nodes and their GPUs, staff only (others list nothing and get 404)."""

    serializer_class = NodeSerializer
    lookup_value_regex = r"[0-9]+"
    permission_classes = [StaffWritesOnly]

    def get_queryset(self):
        return cluster_selectors.node_list(user=self.request.user)


class PartitionChangeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Partition changes, staff only: their steps name workloads of every tenant, so others get 404."""

    serializer_class = PartitionChangeSerializer
    lookup_value_regex = r"[0-9]+"
    permission_classes = [StaffWritesOnly]

    def get_queryset(self):
        return cluster_selectors.partition_change_list(user=self.request.user)
