"""REST API for environments, scoped to the caller's tenants (runners.environments.selectors holds the rule)."""

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response

from common.fields import StrictTypesMixin
from runners.environments import services as environments
from runners.environments.filters import EnvironmentFilter
from runners.environments.models import Environment, EnvironmentState
from tenants.api import dns_label_field
from tenants.models import ENVIRONMENT_NAME_MAX, TENANT_SLUG_MAX, Tenant
from tenants.scoping import TenantScopedMixin
from tenants.selectors import tenant_list


class EnvironmentSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)  # user deleted

    class Meta:
        model = Environment
        fields = [
            "id",
            "tenant",
            "name",
            "namespace",
            "backend",
            "state",
            "status_message",
            "created_by",
            "created_at",
            "state_changed_at",
        ]


class EnvironmentCreateSerializer(StrictTypesMixin, serializers.Serializer):
    tenant = serializers.CharField(max_length=TENANT_SLUG_MAX)
    name = dns_label_field(ENVIRONMENT_NAME_MAX)

    def validate_tenant(self, slug: str) -> Tenant:
        # Another tenant's slug reads exactly like one that does not exist.
        tenant = tenant_list(user=self.context["request"].user).filter(slug=slug).first()
        if tenant is None:
            raise serializers.ValidationError(f"There is no tenant {slug!r} that you belong to.")
        return tenant


class EnvironmentViewSet(
    TenantScopedMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    queryset = Environment.objects.select_related("tenant", "created_by")
    serializer_class = EnvironmentSerializer
    filterset_class = EnvironmentFilter
    lookup_value_regex = r"[0-9]+"

    def refine_queryset(self, queryset):
        if self.action == "list" and not self.request.query_params.get("state"):
            queryset = queryset.exclude(state=EnvironmentState.DELETED)  # deleted ones only when asked for
        return queryset.order_by("-created_at", "-id")

    @extend_schema(request=EnvironmentCreateSerializer, responses={201: EnvironmentSerializer})
    def create(self, request):
        data = EnvironmentCreateSerializer(data=request.data, context={"request": request})
        data.is_valid(raise_exception=True)
        environment = environments.environment_request(actor=request.user, **data.validated_data)
        return Response(EnvironmentSerializer(environment).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={202: EnvironmentSerializer})
    def destroy(self, request, pk):
        environment = self.get_object()
        environment = environments.environment_delete(actor=request.user, environment=environment)
        return Response(EnvironmentSerializer(environment).data, status=status.HTTP_202_ACCEPTED)
