"""REST API for workspaces: create (and start), read, start, stop, delete. JupyterLab itself is reached
through the edge at ``url``, with the portal's session."""

from django.db import transaction
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from runners.workspaces import selectors
from runners.workspaces import services as workspaces
from runners.workspaces.models import Workspace
from tenants.scoping import TenantScopedMixin


class WorkspaceCreateSerializer(serializers.Serializer):
    """The shape a workspace is created in (documentation: the service checks it and refuses unknown fields)."""

    tenant = serializers.CharField(help_text="The tenant's slug.")
    environment = serializers.IntegerField(min_value=1, help_text="One of the tenant's ready environments.")
    name = serializers.RegexField(rf"^{workspaces.NAME_PATTERN}$", max_length=30)
    flavor = serializers.CharField(help_text="A whole GPU, a MIG slice, a time-slice share, or a CPU-only flavor.")
    gpus = serializers.IntegerField(min_value=0, max_value=8, default=1, help_text="Units of the flavor.")
    cpu_milli = serializers.IntegerField(min_value=250, max_value=64_000, required=False)
    memory_mib = serializers.IntegerField(min_value=1024, max_value=512 * 1024, required=False)
    shared = serializers.BooleanField(default=False, help_text="Members of the tenant may open it too.")
    idle_minutes = serializers.IntegerField(min_value=1, max_value=7 * 24 * 60, required=False, allow_null=True,
                                            help_text="Stopped after this long without activity (the portal's "
                                                      "WORKSPACE_IDLE_MINUTES unless given).")
    start = serializers.BooleanField(default=True, help_text="Start it now.")


class WorkspaceSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    flavor = serializers.SlugRelatedField(slug_field="name", read_only=True)
    owner = serializers.SlugRelatedField(slug_field="username", read_only=True)
    url = serializers.SerializerMethodField(help_text="JupyterLab, through the edge, with the portal's sign-in.")
    preemptible = serializers.SerializerMethodField(help_text="Borrowing beyond the guarantee: another tenant's "
                                                              "guaranteed work may stop it.")
    idle_since = serializers.SerializerMethodField()

    class Meta:
        model = Workspace
        fields = ["id", "url", "tenant", "environment", "name", "owner", "flavor", "gpus", "cpu_milli", "memory_mib",
                  "shared", "idle_minutes", "state", "reason", "job", "preemptible", "created_at", "ready_at",
                  "last_activity_at", "idle_since", "state_changed_at"]

    def get_url(self, workspace) -> str:
        request = self.context.get("request")
        path = f"{workspace.base_url}lab"
        return request.build_absolute_uri(path) if request is not None else path

    def get_preemptible(self, workspace) -> bool | None:
        return workspace.job.preemptible if workspace.job is not None else None

    def get_idle_since(self, workspace) -> str | None:
        since = workspaces.idle_since(workspace)
        return since.isoformat() if since else None


class WorkspaceViewSet(TenantScopedMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Workspaces: a member's own, the tenant's where shared (admins see all of the tenant's)."""

    queryset = Workspace.objects.select_related("tenant", "environment", "flavor", "owner", "job")
    serializer_class = WorkspaceSerializer
    lookup_value_regex = r"[0-9]{1,18}"

    def refine_queryset(self, queryset):
        return selectors.visible(queryset, self.request.user)

    def _answer(self, workspace, code=status.HTTP_200_OK) -> Response:
        data = WorkspaceSerializer(self.get_queryset().get(id=workspace.id), context={"request": self.request}).data
        return Response(data, status=code)

    @extend_schema(request=WorkspaceCreateSerializer, responses={201: WorkspaceSerializer})
    def create(self, request):
        with transaction.atomic():
            workspace = workspaces.workspace_create(actor=request.user, data=request.data)
            return self._answer(workspace, status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={202: WorkspaceSerializer})
    @action(detail=True, methods=["post"])
    def start(self, request, pk):
        workspace = workspaces.workspace_start(actor=request.user, workspace=self.get_object())
        return self._answer(workspace, status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: WorkspaceSerializer})
    @action(detail=True, methods=["post"])
    def stop(self, request, pk):
        workspace = workspaces.workspace_stop(actor=request.user, workspace=self.get_object())
        return self._answer(workspace, status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={204: None})
    def destroy(self, request, pk):
        workspaces.workspace_delete(actor=request.user, workspace=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)
