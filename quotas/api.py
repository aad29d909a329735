"""REST API for flavors, prices, quotas, partition profiles, node pools and nodes."""

from decimal import Decimal

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.response import Response

from portal import nulls
from portal.fields import StrictTypesMixin
from quotas import selectors, services
from quotas.models import PartitionChange, PartitionProfile, Quota, ResourceFlavor
from runners import services as runner_services
from runners.models import Gpu, Node, NodePool, PartitionKind
from tenants.models import Tenant
from tenants.scoping import TenantScopedMixin


class StaffWritesOnly(BasePermission):
    """Anyone signed in may read; only staff may change."""

    message = "Only staff can change this."

    def has_permission(self, request, view):
        if not request.user.is_authenticated:
            return False
        return request.method in SAFE_METHODS or request.user.is_staff


# --- Flavors and prices -----------------------------------------------------


class PriceSerializer(StrictTypesMixin, serializers.Serializer):
    price_per_hour = serializers.DecimalField(max_digits=10, decimal_places=4, min_value=Decimal("0"))
    currency = serializers.RegexField(r"^[A-Za-z]{3}$", default="USD", error_messages={"invalid": "Use a 3-letter ISO 4217 code."})
    effective_from = serializers.DateTimeField(required=False)


class FlavorSerializer(serializers.ModelSerializer):
    kubernetes_resource = serializers.SerializerMethodField()
    node_labels = serializers.SerializerMethodField()
    capacity = serializers.SerializerMethodField()
    price = serializers.SerializerMethodField()

    class Meta:
        model = ResourceFlavor
        fields = ["name", "kind", "gpu_model", "mig_profile", "description", "kubernetes_resource", "node_labels",
                  "capacity", "price"]

    def get_kubernetes_resource(self, flavor) -> str:
        return selectors.flavor_kubernetes_resource(flavor)

    def get_node_labels(self, flavor) -> dict[str, str]:
        return selectors.flavor_node_labels(flavor)

    def get_capacity(self, flavor) -> int:
        return selectors.flavor_capacity(flavor)

    def get_price(self, flavor) -> dict | None:
        card = selectors.flavor_price_now(flavor)
        if card is None:
            return None
        return {"price_per_hour": str(card.price_per_hour), "currency": card.currency, "effective_from": card.effective_from}


class FlavorCreateSerializer(StrictTypesMixin, serializers.Serializer):
    name = serializers.RegexField(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=63)
    kind = serializers.ChoiceField(choices=PartitionKind.choices)
    gpu_model = serializers.CharField(max_length=40)
    mig_profile = serializers.CharField(max_length=20, required=False, allow_blank=True, default="")
    description = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")


class FlavorViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    queryset = ResourceFlavor.objects.all()
    serializer_class = FlavorSerializer
    permission_classes = [StaffWritesOnly]
    lookup_field = "name"
    lookup_value_regex = r"[a-z0-9.-]+"

    @extend_schema(request=FlavorCreateSerializer, responses={201: FlavorSerializer})
    def create(self, request):
        data = FlavorCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        flavor = services.flavor_create(actor=request.user, **data.validated_data)
        return Response(FlavorSerializer(flavor).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=PriceSerializer, responses={201: FlavorSerializer})
    @action(detail=True, methods=["post"])
    def prices(self, request, name):
        flavor = self.get_object()
        data = PriceSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        services.price_set(actor=request.user, flavor=flavor, **data.validated_data)
        return Response(FlavorSerializer(flavor).data, status=status.HTTP_201_CREATED)


# --- Quotas -----------------------------------------------------------------


class QuotaSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    flavor = serializers.SlugRelatedField(slug_field="name", read_only=True)
    kubernetes_resource = serializers.SerializerMethodField()

    class Meta:
        model = Quota
        fields = ["id", "tenant", "flavor", "guaranteed", "max", "fair_share_weight", "max_priority",
                  "kubernetes_resource", "updated_at"]

    def get_kubernetes_resource(self, quota) -> str:
        return selectors.flavor_kubernetes_resource(quota.flavor)


class QuotaWriteSerializer(StrictTypesMixin, serializers.Serializer):
    tenant = nulls.SlugRelatedField(slug_field="slug", queryset=Tenant.objects.all())
    flavor = nulls.SlugRelatedField(slug_field="name", queryset=ResourceFlavor.objects.all())
    guaranteed = serializers.IntegerField(min_value=0, max_value=100_000)
    max = serializers.IntegerField(min_value=0, max_value=100_000)
    fair_share_weight = serializers.DecimalField(max_digits=6, decimal_places=2, min_value=Decimal("0.01"), default=Decimal("1"))
    max_priority = serializers.IntegerField(min_value=0, max_value=1000, default=100)


class QuotaUpdateSerializer(StrictTypesMixin, serializers.Serializer):
    guaranteed = serializers.IntegerField(min_value=0, max_value=100_000, required=False)
    max = serializers.IntegerField(min_value=0, max_value=100_000, required=False)
    fair_share_weight = serializers.DecimalField(max_digits=6, decimal_places=2, min_value=Decimal("0.01"), required=False)
    max_priority = serializers.IntegerField(min_value=0, max_value=1000, required=False)


class QuotaViewSet(TenantScopedMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Tenants read their own quotas; staff set everyone's."""

    queryset = Quota.objects.select_related("tenant", "flavor")
    serializer_class = QuotaSerializer
    lookup_value_regex = r"[0-9]+"
    permission_classes = [StaffWritesOnly]

    def refine_queryset(self, queryset):
        tenant = nulls.query_param(self.request, "tenant")
        if tenant:
            queryset = queryset.filter(tenant__slug=tenant)
        return queryset.order_by("tenant__slug", "flavor__name")

    @extend_schema(parameters=[OpenApiParameter("tenant", str, description="Only this tenant's quotas (its slug).")])
    def list(self, request):
        return super().list(request)

    @extend_schema(request=QuotaWriteSerializer, responses={201: QuotaSerializer})
    def create(self, request):
        data = QuotaWriteSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        quota = services.quota_set(actor=request.user, must_be_new=True, **data.validated_data)
        return Response(QuotaSerializer(quota).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=QuotaUpdateSerializer, responses={200: QuotaSerializer})
    def partial_update(self, request, pk):
        quota = self.get_object()
        data = QuotaUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        quota = services.quota_set(actor=request.user, tenant=quota.tenant, flavor=quota.flavor, **data.validated_data)
        return Response(QuotaSerializer(quota).data)

    @extend_schema(responses={204: None})
    def destroy(self, request, pk):
        services.quota_delete(actor=request.user, quota=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


# --- Partition profiles -----------------------------------------------------


class PartitionProfileSerializer(serializers.ModelSerializer):
    gpu_operator = serializers.SerializerMethodField(
        help_text="Node labels, mig-parted config and device plugin config this profile applies."
    )

    class Meta:
        model = PartitionProfile
        fields = ["id", "name", "gpu_model", "kind", "layout", "replicas", "gpu_operator", "created_at"]

    def get_gpu_operator(self, profile) -> dict:
        return selectors.partition_profile_configs(profile)


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
        profile = services.partition_profile_create(actor=request.user, **data.validated_data)
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
        fields = ["id", "name", "gpu_model", "partition_profile", "nodes", "latest_change"]

    def get_latest_change(self, pool) -> dict | None:
        # A change's steps name the workloads it drained, from every tenant: staff only.
        request = self.context.get("request")
        if request is None or not request.user.is_staff:
            return None
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


class ApplyPreviewSerializer(serializers.Serializer):
    capacity = CapacityChangeSerializer(many=True)


class NodePoolViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    queryset = NodePool.objects.prefetch_related("nodes").select_related("partition_profile")
    serializer_class = NodePoolSerializer
    lookup_value_regex = r"[0-9]+"
    permission_classes = [StaffWritesOnly]

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
        result = runner_services.node_pool_apply(
            actor=request.user, pool=pool, dry_run=dry_run == "true", **data.validated_data
        )
        if result["change"] is None:
            return Response(ApplyPreviewSerializer(result).data)
        return Response(PartitionChangeSerializer(result["change"]).data, status=status.HTTP_202_ACCEPTED)


class NodeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    queryset = Node.objects.select_related("pool").prefetch_related("gpus")
    serializer_class = NodeSerializer
    lookup_value_regex = r"[0-9]+"
    permission_classes = [StaffWritesOnly]


class PartitionChangeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Partition changes, staff only: their steps name workloads of every tenant, so others get 404."""

    queryset = PartitionChange.objects.select_related("pool", "profile")
    serializer_class = PartitionChangeSerializer
    lookup_value_regex = r"[0-9]+"
    permission_classes = [StaffWritesOnly]

    def get_queryset(self):
        if not self.request.user.is_staff:
            return PartitionChange.objects.none()
        return super().get_queryset()
