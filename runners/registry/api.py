"""REST API of the model registry, under a tenant: list models, promote a checkpoint, read a model and a version.

Members promote (any role but viewer), admins and owners delete a version, every member reads; anyone else gets 404. A model name or version
that does not exist is a 404 whose detail names the field (``model: ...``, ``version: ...``).
"""

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter

from runners.registry import selectors, services
from runners.registry.models import MODEL_NAME_PATTERN, ModelVersion
from tenants.scoping import TenantScopedMixin
from tenants.selectors import tenant_get


class WeightsSerializer(serializers.Serializer):
    sha256 = serializers.CharField(source="weights_sha256")
    bytes = serializers.IntegerField(source="weights_bytes")
    format = serializers.CharField(source="weights_format")


class ModelVersionSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugField(source="tenant.slug", read_only=True)
    weights = WeightsSerializer(source="*")
    job = serializers.SerializerMethodField(help_text="The job it was promoted from: its id and name as they were "
                                                      "then, and whether the job still exists.")
    created_by = serializers.CharField(source="created_by.username", read_only=True, allow_null=True, default=None)

    class Meta:
        model = ModelVersion
        fields = ["id", "tenant", "name", "version", "weights", "job", "step", "template", "lineage", "created_at",
                  "created_by"]

    @staticmethod
    def get_job(version) -> dict:
        return {"id": version.source_job_number, "name": version.source_job_name,
                "exists": version.source_job_id is not None}


class ModelSummarySerializer(serializers.Serializer):
    name = serializers.CharField()
    versions = serializers.IntegerField(help_text="How many versions it has.")
    newest = serializers.IntegerField(help_text="Its newest version's number.")
    updated_at = serializers.DateTimeField(help_text="When its newest version was promoted.")


class PromoteSerializer(serializers.Serializer):
    """The shape of a promotion (documentation: the service checks it and refuses unknown fields)."""

    name = serializers.RegexField(rf"^{MODEL_NAME_PATTERN}$", help_text="The model: a new one, or a new version of it.")
    job = serializers.IntegerField(help_text="One of the tenant's training jobs.")
    step = serializers.IntegerField(required=False, help_text="Which checkpoint of the job; its newest unless given.")


class ModelViewSet(TenantScopedMixin, viewsets.GenericViewSet):
    """A tenant's models, each a list of immutable versions promoted from its jobs' checkpoints."""

    queryset = ModelVersion.objects.select_related("tenant", "created_by")
    serializer_class = ModelVersionSerializer
    lookup_field = "name"
    # The URL takes any run of a name's characters (no nested group, so every route reads as one template);
    # a string that is not a model's name finds no model: 404, as any unknown name.
    lookup_value_regex = r"[-a-z0-9]{1,64}"

    def tenant(self):
        return tenant_get(user=self.request.user, slug=self.kwargs["tenant_slug"])

    def refine_queryset(self, queryset):
        return queryset.filter(tenant=self.tenant())

    @extend_schema(responses={200: ModelSummarySerializer(many=True)})
    def list(self, request, tenant_slug):
        rows = selectors.model_list(user=request.user, tenant=self.tenant())
        page = self.paginate_queryset(rows)
        return self.get_paginated_response(ModelSummarySerializer(page, many=True).data)

    @extend_schema(request=PromoteSerializer, responses={201: ModelVersionSerializer, 200: ModelVersionSerializer})
    def create(self, request, tenant_slug):
        """Promote a checkpoint: 201 with a new version, 200 with the version that already holds this checkpoint."""
        version, created = services.model_promote(actor=request.user, tenant=self.tenant(), data=request.data)
        return Response(ModelVersionSerializer(version).data,
                        status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(responses={200: inline_serializer("ModelWithVersions", {
        "name": serializers.CharField(), "versions": ModelVersionSerializer(many=True)})})
    def retrieve(self, request, tenant_slug, name):
        """A model and its versions, newest first (at most 200)."""
        versions = selectors.model_versions(user=request.user, tenant=self.tenant(), name=name)
        return Response({"name": name, "versions": ModelVersionSerializer(versions[:200], many=True).data})

    @extend_schema(methods=["GET"], responses={200: ModelVersionSerializer})
    @extend_schema(methods=["DELETE"], responses={204: None})
    @action(detail=True, methods=["get", "delete"], url_path=r"versions/(?P<version>[0-9]{1,9})")
    def version(self, request, tenant_slug, name, version):
        """GET: one version, its weights and its lineage. DELETE (admins and owners): the version leaves every read
        and its weights go with the next sweep; 409 naming the endpoints while any serves it."""
        if request.method == "DELETE":
            services.model_version_delete(actor=request.user, tenant=self.tenant(), name=name, version=int(version))
            return Response(status=status.HTTP_204_NO_CONTENT)
        found = selectors.version_get(user=request.user, tenant=self.tenant(), name=name, version=int(version))
        return Response(ModelVersionSerializer(found).data)


router = SimpleRouter()
router.register(r"tenants/(?P<tenant_slug>[a-z0-9-]+)/models", ModelViewSet, basename="tenant-model")
