"""REST API for environments, scoped to the caller's tenants (runners.environments.selectors holds the rule)."""

import yaml
from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import exceptions, mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.renderers import BaseRenderer, JSONRenderer
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
            "workspace_image",
        ]


WORKSPACE_IMAGE_HELP = ("The image the environment's workspaces run on Kubernetes, from ALLOWED_IMAGE_REGISTRIES "
                        "(with JupyterLab and the portal's workspace server); \"\" for the portal's own.")


class EnvironmentCreateSerializer(StrictTypesMixin, serializers.Serializer):
    tenant = serializers.CharField(max_length=TENANT_SLUG_MAX)
    name = dns_label_field(ENVIRONMENT_NAME_MAX)
    workspace_image = serializers.CharField(max_length=255, required=False, allow_blank=True,
                                            help_text=WORKSPACE_IMAGE_HELP)

    def validate_tenant(self, slug: str) -> Tenant:
        # Another tenant's slug reads exactly like one that does not exist.
        tenant = tenant_list(user=self.context["request"].user).filter(slug=slug).first()
        if tenant is None:
            raise serializers.ValidationError(f"There is no tenant {slug!r} that you belong to.")
        return tenant


class EnvironmentChangeSerializer(StrictTypesMixin, serializers.Serializer):
    """What may change on an environment (its tenant's admins): the image its workspaces run."""

    workspace_image = serializers.CharField(max_length=255, allow_blank=True, help_text=WORKSPACE_IMAGE_HELP)


class KubeconfigRenderer(BaseRenderer):
    """Lets a client ask for `application/yaml`; the kubeconfig itself is sent as it is, errors stay JSON."""

    media_type = "application/yaml"
    format = "yaml"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None) -> bytes:
        return (data if isinstance(data, str) else yaml.safe_dump(data)).encode(self.charset)


class Gone(exceptions.APIException):
    status_code = status.HTTP_410_GONE
    default_detail = "This environment was deleted."
    default_code = "gone"


class ClusterUnavailable(exceptions.APIException):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_detail = "The cluster cannot be reached now."
    default_code = "cluster_unavailable"


class ClusterRefused(exceptions.APIException):
    status_code = status.HTTP_502_BAD_GATEWAY
    default_detail = "The cluster refused the request."
    default_code = "cluster_refused"


_PROBLEM = inline_serializer("EnvironmentProblem", fields={"detail": serializers.CharField()})
TOKEN_EXPIRES_HEADER = "X-Token-Expires-At"


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

    def get_renderers(self):
        if self.action == "kubeconfig":
            return [JSONRenderer(), KubeconfigRenderer()]
        return super().get_renderers()

    def finalize_response(self, request, response, *args, **kwargs):
        # Only the kubeconfig is YAML: an error answer is JSON whatever was asked for.
        if getattr(request, "accepted_renderer", None) is not None and isinstance(
            request.accepted_renderer, KubeconfigRenderer
        ):
            request.accepted_renderer, request.accepted_media_type = JSONRenderer(), JSONRenderer.media_type
        return super().finalize_response(request, response, *args, **kwargs)

    def get_object(self):
        environment = super().get_object()
        try:
            environments.environment_require_live(environment)
        except environments.EnvironmentGone as exc:
            raise Gone(str(exc)) from None
        return environment

    @extend_schema(responses={
        200: EnvironmentSerializer,
        (410, "application/json"): OpenApiResponse(_PROBLEM, description="The environment was deleted."),
    })
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(
        responses={
            (200, "application/yaml"): OpenApiResponse(
                OpenApiTypes.STR,
                description="A kubeconfig (a download) for this environment's namespace only, with a token of the "
                            "caller's own that expires at the time in X-Token-Expires-At (KUBECONFIG_TOKEN_TTL_S).",
            ),
            (409, "application/json"): OpenApiResponse(
                _PROBLEM, description="The environment is not on Kubernetes (it has no kubeconfig), or not ready yet; "
                                      "or the portal will not hand one out as configured (the answer names the setting)."),
            (410, "application/json"): OpenApiResponse(_PROBLEM, description="The environment was deleted."),
            (502, "application/json"): OpenApiResponse(
                _PROBLEM, description="The cluster refused to make the access or the token (the answer names it)."),
            (503, "application/json"): OpenApiResponse(
                _PROBLEM, description="The cluster could not be reached (the answer names it); try again."),
        },
        parameters=[OpenApiParameter(TOKEN_EXPIRES_HEADER, OpenApiTypes.DATETIME, OpenApiParameter.HEADER,
                                     response=[200], description="When the token in the kubeconfig stops working.")],
    )
    @action(detail=True, methods=["get"])
    def kubeconfig(self, request, pk):
        """Your own kubeconfig for the environment's namespace: a ServiceAccount bound to your role there, and a
        short-lived token. Never inside a transaction: the cluster is asked for the token now."""
        environment = self.get_object()
        try:
            config = environments.environment_kubeconfig(actor=request.user, environment=environment)
        except environments.ClusterUnavailable as exc:
            raise ClusterUnavailable(str(exc)) from None
        except environments.ClusterRefused as exc:
            raise ClusterRefused(str(exc)) from None
        response = HttpResponse(config.text, content_type="application/yaml; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="kubeconfig-{environment.namespace}.yaml"'
        response[TOKEN_EXPIRES_HEADER] = config.expires_at.isoformat()
        response["Cache-Control"] = "no-store"  # it holds a secret
        return response

    @extend_schema(request=EnvironmentCreateSerializer, responses={201: EnvironmentSerializer})
    def create(self, request):
        data = EnvironmentCreateSerializer(data=request.data, context={"request": request})
        data.is_valid(raise_exception=True)
        environment = environments.environment_request(actor=request.user, **data.validated_data)
        return Response(EnvironmentSerializer(environment).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=EnvironmentChangeSerializer, responses={200: EnvironmentSerializer})
    def partial_update(self, request, pk):
        """Change the image the environment's workspaces run; any other field is refused by name."""
        environment = self.get_object()
        unknown = sorted(set(request.data) - set(EnvironmentChangeSerializer().fields)) if hasattr(
            request.data, "keys") else []
        if unknown:
            raise exceptions.ValidationError({unknown[0]: ["Cannot be changed here."]})
        data = EnvironmentChangeSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        environment = environments.environment_set_workspace_image(
            actor=request.user, environment=environment, image=data.validated_data["workspace_image"])
        return Response(EnvironmentSerializer(environment).data)

    @extend_schema(responses={
        202: EnvironmentSerializer,
        (410, "application/json"): OpenApiResponse(_PROBLEM, description="The environment was deleted already."),
    })
    def destroy(self, request, pk):
        environment = self.get_object()
        environment = environments.environment_delete(actor=request.user, environment=environment)
        return Response(EnvironmentSerializer(environment).data, status=status.HTTP_202_ACCEPTED)
