"""REST API for flavors, prices and quotas."""

from decimal import Decimal

from django.db.models import Prefetch
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.response import Response

from common import nulls
from common.fields import StrictTypesMixin
from quotas import selectors, services
from quotas.filters import QuotaFilter
from quotas.models import PartitionKind, PriceCard, Quota, ResourceFlavor
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
        return flavor.capacity

    def get_price(self, flavor) -> dict | None:
        # The view's list read the cards in force with one query for all flavors (FlavorViewSet.get_queryset).
        in_force = getattr(flavor, "prices_in_force", None)
        card = (in_force[0] if in_force else None) if in_force is not None else selectors.flavor_price_now(flavor)
        if card is None:
            return None
        return {"price_per_hour": str(card.price_per_hour), "currency": card.currency, "effective_from": card.effective_from}


class FlavorCreateSerializer(StrictTypesMixin, serializers.Serializer):
    name = serializers.RegexField(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=63)
    kind = serializers.ChoiceField(choices=PartitionKind.choices)
    gpu_model = serializers.CharField(max_length=40)
    mig_profile = serializers.CharField(max_length=20, required=False, allow_blank=True, default="")
    description = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")


class FlavorDescribeSerializer(StrictTypesMixin, serializers.Serializer):
    description = serializers.CharField(max_length=200, allow_blank=True)

    def validate(self, attrs):
        others = sorted(set(self.initial_data) - set(self.fields))
        if others:
            raise serializers.ValidationError(
                {name: ["Only the description of a flavor can change; its name and shape stay."] for name in others}
            )
        return attrs


class FlavorViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    queryset = ResourceFlavor.objects.all()
    serializer_class = FlavorSerializer
    permission_classes = [StaffWritesOnly]
    lookup_field = "name"
    lookup_value_regex = r"[a-z0-9.-]+"

    def get_queryset(self):
        # The price cards in force now, newest first, for every flavor of the page in one query (the
        # serializer reads the first; selectors.flavor_price_now says the same for one flavor).
        if self.action not in ("list", "retrieve"):
            return super().get_queryset()
        return super().get_queryset().prefetch_related(Prefetch(
            "prices", queryset=PriceCard.objects.filter(effective_from__lte=timezone.now()).order_by("-effective_from"),
            to_attr="prices_in_force",
        ))

    @extend_schema(request=FlavorCreateSerializer, responses={201: FlavorSerializer})
    def create(self, request):
        data = FlavorCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        flavor = services.flavor_create(actor=request.user, **data.validated_data)
        return Response(FlavorSerializer(flavor).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=FlavorDescribeSerializer, responses={200: FlavorSerializer})
    def partial_update(self, request, name):
        flavor = self.get_object()
        data = FlavorDescribeSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        services.flavor_describe(actor=request.user, flavor=flavor, **data.validated_data)
        return Response(FlavorSerializer(flavor).data)

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
    # Left out, these take the model's defaults (quotas.models.Quota).
    fair_share_weight = serializers.DecimalField(max_digits=6, decimal_places=2, min_value=Decimal("0.01"), required=False)
    max_priority = serializers.IntegerField(min_value=0, max_value=1000, required=False)


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
    filterset_class = QuotaFilter

    def refine_queryset(self, queryset):
        return queryset.order_by("tenant__slug", "flavor__name")

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
