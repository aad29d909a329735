"""REST API for inference endpoints: deploy, read, scale, roll out, stop; generate goes through the router."""

from django.db import transaction
from django.utils import timezone
from drf_spectacular.utils import extend_schema, extend_schema_field, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from runners.backends import engines as engine_kinds
from runners.inference import services as endpoints
from runners.inference.models import EndpointSample, InferenceEndpoint, Replica, ScaleEvent
from runners.jobs.attempts import open_attempts
from runners.jobs.models import JOB_FINAL_STATES
from tenants.scoping import TenantScopedMixin


def _bounded(field: str, help_text: str = "") -> serializers.IntegerField:
    low, high, default = endpoints.BOUNDS[field]
    return serializers.IntegerField(min_value=low, max_value=high, default=default, help_text=help_text)


class SourceSerializer(serializers.Serializer):
    model = serializers.CharField(required=False, help_text="One of the tenant's models (the model registry).")
    version = serializers.IntegerField(required=False, help_text="Which version of the model; its newest unless given.")
    job = serializers.IntegerField(required=False, help_text="One of the tenant's training jobs: its checkpoint, "
                                                             "promoted to a version of the model named as the endpoint.")
    step = serializers.IntegerField(required=False, help_text="Which checkpoint of the job; its newest unless given.")
    image = serializers.CharField(required=False, help_text="A custom image from the allow-list (Kubernetes only).")
    path = serializers.CharField(required=False, help_text="A foreign engine's model: a folder in its image "
                                                           "(/models/<name>) or a name the engine resolves.")


class EndpointCreateSerializer(serializers.Serializer):
    """The shape an endpoint is deployed in (documentation: the service checks it and refuses unknown fields)."""

    tenant = serializers.CharField(help_text="The tenant's slug.")
    environment = serializers.IntegerField(min_value=1, help_text="One of the tenant's ready environments.")
    name = serializers.RegexField(rf"^{endpoints.NAME_PATTERN}$", max_length=endpoints.NAME_MAX)
    source = SourceSerializer()
    flavor = serializers.CharField(help_text="A flavor the tenant has a quota for.")
    gpus_per_replica = _bounded("gpus_per_replica", "1 for MIG and time-slice flavors.")
    min_replicas = _bounded("min_replicas", "Never preempted; min_replicas x gpus_per_replica must fit the guarantee.")
    max_replicas = _bounded("max_replicas")
    warm_replicas = _bounded("warm_replicas", "Kept ready beyond what the load needs.")
    queue_limit = _bounded("queue_limit", "Requests a replica admits beyond its running batch; past it, 429.")
    batch_token_budget = _bounded("batch_token_budget", "Prompt plus max_tokens of the running batch, at most.")
    max_batch_wait_ms = _bounded("max_batch_wait_ms")
    default_deadline_ms = _bounded("default_deadline_ms", "For requests that give no deadline_ms.")
    engine = serializers.ChoiceField(choices=list(engine_kinds.ENGINES), default=engine_kinds.SHIPPED, help_text=(
        "shipped: the portal's server. vllm, tgi, sglang: that OpenAI-compatible engine's image (Kubernetes only), "
        "serving source {\"path\": ...}; queue_limit, batch_token_budget and max_batch_wait_ms are the shipped "
        "server's only."))
    image = serializers.CharField(required=False, help_text="A foreign engine's image, from an allowed registry.")
    max_model_len = serializers.IntegerField(
        required=False, allow_null=True, min_value=engine_kinds.MAX_MODEL_LEN[0],
        max_value=engine_kinds.MAX_MODEL_LEN[1], help_text="A foreign engine's longest prompt plus "
                                                                     "completion, in tokens (the model's own unless given).")
    dtype = serializers.ChoiceField(choices=list(engine_kinds.DTYPES), required=False,
                                    help_text="A foreign engine's weights type (auto: the model's own; TGI: no float32).")


class ScaleSerializer(serializers.Serializer):
    min_replicas = serializers.IntegerField(required=False)
    max_replicas = serializers.IntegerField(required=False)
    warm_replicas = serializers.IntegerField(required=False)


class RolloutSerializer(serializers.Serializer):
    source = SourceSerializer()
    image = serializers.CharField(required=False, help_text="A foreign engine's endpoint: its new image.")


class ServedVersionSerializer(serializers.Serializer):
    name = serializers.CharField()
    version = serializers.IntegerField()


def _served(version) -> dict | None:
    return {"name": version.name, "version": version.version} if version is not None else None


class ReplicaSerializer(serializers.ModelSerializer):
    job = serializers.IntegerField(source="job_id")
    state = serializers.CharField(source="job.state")
    reason = serializers.CharField(source="job.reason")
    projected_start = serializers.DateTimeField(
        source="job.projected_start", allow_null=True, help_text="While it waits: when the scheduler expects it to start.")
    stop_deadline = serializers.DateTimeField(
        source="job.stop_deadline", allow_null=True, help_text="While it is stopping: when it is stopped at the latest.")
    preemptible = serializers.BooleanField(source="job.preemptible")
    node = serializers.SerializerMethodField()
    gpus = serializers.SerializerMethodField()
    model = serializers.SerializerMethodField(help_text="The model version this replica serves.")

    class Meta:
        model = Replica
        fields = ["id", "slot", "generation", "job", "state", "reason", "projected_start", "stop_deadline",
                  "preemptible", "ready", "retiring", "node", "gpus", "model"]

    @extend_schema_field(ServedVersionSerializer(allow_null=True))
    def get_model(self, replica) -> dict | None:
        return _served(replica.model_version)

    def _placement(self, replica) -> dict:
        attempt = self.context.get("attempts", {}).get(replica.job_id)
        return attempt.placement[0] if attempt and attempt.placement else {}

    def get_node(self, replica) -> str | None:
        return self._placement(replica).get("node")

    def get_gpus(self, replica) -> list[int]:
        return self._placement(replica).get("gpus", [])


class ScaleEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = ScaleEvent
        fields = ["at", "from_replicas", "to_replicas", "reason"]


class EndpointSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    flavor = serializers.SlugRelatedField(slug_field="name", read_only=True)
    source = serializers.SerializerMethodField()
    model = serializers.SerializerMethodField(help_text="The model version it serves now (null for an image).")
    replicas = serializers.SerializerMethodField()
    scale_events = serializers.SerializerMethodField()
    url = serializers.SerializerMethodField()

    class Meta:
        model = InferenceEndpoint
        fields = [
            "id", "tenant", "environment", "name", "source", "model", "flavor", "gpus_per_replica", "min_replicas",
            "max_replicas", "warm_replicas", "desired_replicas", "generation", "state", "reason", "url", "replicas",
            "scale_events", "created_at", "spec",
        ]

    def get_source(self, endpoint) -> dict:
        source = dict(endpoint.spec["source"])
        source.pop("uri", None)
        return source

    @extend_schema_field(ServedVersionSerializer(allow_null=True))
    def get_model(self, endpoint) -> dict | None:
        return _served(endpoint.model_version)

    @extend_schema_field(ReplicaSerializer(many=True))
    def get_replicas(self, endpoint) -> list:
        live = [r for r in endpoint.replicas.all() if r.job.state not in JOB_FINAL_STATES]
        attempts = open_attempts([r.job for r in live])
        return ReplicaSerializer(live, many=True, context={"attempts": attempts}).data

    @extend_schema_field(ScaleEventSerializer(many=True))
    def get_scale_events(self, endpoint) -> list:
        return ScaleEventSerializer(endpoint.scale_events.all()[:20], many=True).data

    def get_url(self, endpoint) -> str:
        path = f"/serve/{endpoint.tenant.slug}/{endpoint.name}"
        request = self.context.get("request")
        return request.build_absolute_uri(path) if request else path


class SampleSerializer(serializers.ModelSerializer):
    class Meta:
        model = EndpointSample
        fields = ["at", "ready_replicas", "queue_depth", "running", "requests_per_s", "shed_per_s", "expired_per_s",
                  "p50_ms", "p99_ms", "kv_cache_use"]


class EndpointViewSet(TenantScopedMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Inference endpoints of the caller's tenants: deploy, scale, roll out and stop (members), read (viewers too).

    Clients generate with ``POST {url}/v1/generate`` and a tenant member's API token."""

    queryset = InferenceEndpoint.objects.select_related("tenant", "flavor", "model_version").prefetch_related(
        "replicas__job", "replicas__model_version", "scale_events")
    serializer_class = EndpointSerializer
    lookup_value_regex = r"[0-9]{1,18}"

    def _answer(self, endpoint, code=status.HTTP_200_OK) -> Response:
        data = EndpointSerializer(self.get_queryset().get(id=endpoint.id), context={"request": self.request}).data
        return Response(data, status=code)

    @extend_schema(request=EndpointCreateSerializer, responses={201: EndpointSerializer})
    def create(self, request):
        with transaction.atomic():
            endpoint = endpoints.endpoint_deploy(actor=request.user, data=request.data)
            return self._answer(endpoint, status.HTTP_201_CREATED)

    @extend_schema(request=ScaleSerializer, responses={202: EndpointSerializer})
    @action(detail=True, methods=["post"])
    def scale(self, request, pk):
        endpoint = endpoints.endpoint_scale(actor=request.user, endpoint=self.get_object(), data=request.data)
        return self._answer(endpoint, status.HTTP_202_ACCEPTED)

    @extend_schema(request=RolloutSerializer, responses={202: EndpointSerializer})
    @action(detail=True, methods=["post"])
    def rollout(self, request, pk):
        endpoint = endpoints.endpoint_rollout(actor=request.user, endpoint=self.get_object(), data=request.data)
        return self._answer(endpoint, status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: EndpointSerializer})
    @action(detail=True, methods=["post"])
    def stop(self, request, pk):
        endpoint = endpoints.endpoint_stop(actor=request.user, endpoint=self.get_object())
        return self._answer(endpoint, status.HTTP_202_ACCEPTED)

    @extend_schema(responses={200: inline_serializer("EndpointSamples", {"samples": SampleSerializer(many=True)})})
    @action(detail=True, methods=["get"])
    def samples(self, request, pk):
        """The last hour of what the replicas reported, one sample per reconcile pass (at most 900, evenly spread)."""
        endpoint = self.get_object()
        rows = list(endpoint.samples.filter(at__gte=timezone.now() - timezone.timedelta(hours=1)).order_by("at"))
        if len(rows) > 900:
            step = len(rows) / 900
            rows = [rows[int(i * step)] for i in range(900)]
        return Response({"samples": SampleSerializer(rows, many=True).data})
