"""REST API for training jobs: submit, read, cancel, logs (per replica and attempt, and as a file) and the loss curve."""

import re
from pathlib import PurePosixPath

from django.db import transaction
from django.http import FileResponse, HttpResponse, StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import Throttled
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.response import Response

from common import nulls
from common.errors import Conflict, TooMany
from runners.datasets.selectors import UnknownDataset
from runners.jobs import selectors as job_selectors
from runners.jobs import services as jobs
from runners.jobs.filters import JobFilter
from runners.jobs.models import Checkpoint, Job, JobAttempt, JobEvent
from runners.jobs.serializers import PlainFieldsMixin, PrefetchedListSerializer, attach_nested_rows
from runners.workloads.env_policy import TRAINER_MIN_MEMORY_MIB
from tenants.scoping import TenantScopedMixin
from tenants.selectors import tenant_list


class TopologySerializer(serializers.Serializer):
    level = serializers.ChoiceField(choices=jobs.TOPOLOGY_LEVELS, default="none")
    mode = serializers.ChoiceField(choices=jobs.TOPOLOGY_MODES, default=jobs.DEFAULT_TOPOLOGY_MODE)


def _bounded(field: str, help_text: str = "") -> serializers.IntegerField:
    """An integer field of the submit schema with the spec check's own bounds and default (runners.jobs.BOUNDS)."""
    low, high = jobs.BOUNDS[field]
    default = jobs.DEFAULTS[field]
    options = {"default": default} if default is not None else {"required": False}
    return serializers.IntegerField(min_value=low, max_value=high, help_text=help_text, **options)


def _trainer_settings_text() -> str:
    """The shipped trainer's settings, each with its bounds and default, in words (the spec check's table)."""
    return "; ".join(f"{name} {low} to {high}, default {default}"
                     for name, (_kind, low, high, default) in jobs.HYPERPARAMETERS.items())


class DatasetRefSerializer(serializers.Serializer):
    name = serializers.CharField(help_text="A dataset's name, or owner/name for one shared with the tenant.")
    version = serializers.JSONField(required=False, help_text="A version's number, or latest (the default).")


class JobSubmitSerializer(serializers.Serializer):
    """The shape a job is submitted in (documentation, generated from the spec check's tables: the service checks
    it, and refuses unknown fields)."""

    tenant = serializers.CharField(help_text="The tenant's slug.")
    environment = serializers.IntegerField(min_value=1, max_value=2**31 - 1,
                                           help_text="One of the tenant's ready environments.")
    name = serializers.RegexField(rf"^{jobs.NAME_PATTERN}$", max_length=jobs.NAME_MAX)
    template = serializers.ChoiceField(choices=jobs.TEMPLATES, default=jobs.DEFAULTS["template"])
    replicas = _bounded("replicas")
    flavor = serializers.CharField(help_text="A flavor the tenant has a quota for.")
    gpus_per_replica = _bounded("gpus_per_replica", "1 for MIG and time-slice flavors; at most what one node has.")
    cpu_milli_per_replica = _bounded("cpu_milli_per_replica")
    memory_mib_per_replica = _bounded(
        "memory_mib_per_replica", f"At least {TRAINER_MIN_MEMORY_MIB} for the pytorch-ddp template.")
    topology = TopologySerializer(required=False)
    priority = _bounded("priority", "At most the tenant's max_priority for the flavor.")
    preemptible = serializers.BooleanField(default=jobs.DEFAULTS["preemptible"])
    steps = _bounded("steps")
    checkpoint_every_steps = _bounded(
        "checkpoint_every_steps",
        f"At most steps; {jobs.DEFAULT_CHECKPOINT_EVERY_STEPS} (or steps, when fewer) unless given; 0: only at the end.")
    max_runtime_s = _bounded("max_runtime_s", "The job's total across attempts, counted from the trainer's first step.")
    max_retries = _bounded("max_retries")
    env = serializers.DictField(child=serializers.CharField(max_length=jobs.MAX_ENV_VALUE), required=False,
                                help_text="Variables for the replicas; names the runtimes read are refused.")
    hyperparameters = serializers.JSONField(
        required=False,
        help_text=f"pytorch-ddp: the shipped trainer's settings ({_trainer_settings_text()}). script: any JSON object of at most {jobs.SCRIPT_HYPERPARAMETERS_MAX_BYTES} "
                  f"bytes, handed to the script as PORTAL_HYPERPARAMETERS. custom: none.")
    image = serializers.CharField(allow_null=True, required=False,
                                  help_text="custom (required) and script (optional; else the portal's runtime "
                                            "image) templates, Kubernetes only: from ALLOWED_IMAGE_REGISTRIES.")
    command = serializers.ListField(
        child=serializers.CharField(max_length=jobs.COMMAND_ARG_MAX), allow_null=True, required=False,
        min_length=1, max_length=jobs.COMMAND_MAX_ARGS,
        help_text="custom and script templates: the argument list run as given (never through a shell); a string is "
                  "refused. A script's runs in its bundle's folder.")
    bundle = serializers.RegexField(
        rf"^{jobs.BUNDLE_PATTERN}$", allow_null=True, required=False,
        help_text="script template: the SHA-256 of one of the tenant's bundles (/api/v1/tenants/{slug}/bundles/).")
    checkpoint_retention = serializers.JSONField(
        required=False, allow_null=True,
        help_text="The job's checkpoint retention in the store: keep_newest, keep_best (by the reported loss), "
                  "keep_every (every K-th checkpoint), each a count or null; null follows the tenant's policy.")
    datasets = DatasetRefSerializer(
        many=True, required=False,
        help_text="The datasets the job reads (its own, or owner/name for one shared with it); an omitted version or "
                  "latest is pinned at submit to the newest sealed one. ctx.dataset(name) opens each.")


class PlacementSerializer(serializers.Serializer):
    replica = serializers.IntegerField()
    node = serializers.CharField()
    gpus = serializers.ListField(child=serializers.IntegerField())
    mig_profile = serializers.CharField(required=False)
    mig_start = serializers.IntegerField(required=False)


class JobAttemptSerializer(PlainFieldsMixin, serializers.ModelSerializer):
    placement = PlacementSerializer(many=True)

    class Meta:
        model = JobAttempt
        list_serializer_class = PrefetchedListSerializer
        fields = ["number", "placement", "started_at", "ended_at", "outcome", "exit_code", "reason", "resumed_from_step"]


class CheckpointSerializer(PlainFieldsMixin, serializers.ModelSerializer):
    class Meta:
        model = Checkpoint
        list_serializer_class = PrefetchedListSerializer
        fields = ["step", "bytes", "created_at", "uri", "store_state", "durable_at"]


class JobEventSerializer(PlainFieldsMixin, serializers.ModelSerializer):
    class Meta:
        model = JobEvent
        list_serializer_class = PrefetchedListSerializer
        fields = ["at", "from_state", "to_state", "reason"]


class JobSerializer(PlainFieldsMixin, serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    flavor = serializers.SlugRelatedField(slug_field="name", read_only=True)
    submitted_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)
    attempts = JobAttemptSerializer(many=True, read_only=True)
    checkpoints = CheckpointSerializer(many=True, read_only=True)
    events = JobEventSerializer(many=True, read_only=True)

    class Meta:
        model = Job
        fields = [
            "id", "tenant", "environment", "name", "kind", "flavor", "replicas", "gpus_per_replica", "priority",
            "preemptible", "state", "reason", "queue_position", "projected_start", "stop_deadline", "failures", "spec",
            "submitted_by", "submitted_at",
            "started_at", "finished_at", "attempts", "checkpoints", "events",
        ]


class JobLogsSerializer(serializers.Serializer):
    attempt = serializers.IntegerField(allow_null=True)
    replica = serializers.IntegerField()
    text = serializers.CharField(allow_blank=True)


class MetricPointSerializer(serializers.Serializer):
    attempt = serializers.IntegerField()
    step = serializers.IntegerField()
    loss = serializers.FloatField(allow_null=True)
    samples_per_s = serializers.FloatField(allow_null=True)
    time = serializers.CharField()


class JobMetricsSerializer(serializers.Serializer):
    series = MetricPointSerializer(many=True)
    steps_recorded = serializers.IntegerField(help_text="How many steps the series spans (before downsampling).")
    first_step = serializers.IntegerField(allow_null=True)
    last_step = serializers.IntegerField(allow_null=True)


def _query_int(request, name: str, default: int, low: int, high: int) -> int:
    raw = nulls.query_param(request, name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise serializers.ValidationError({name: "A whole number."}) from None
    if not low <= value <= high:
        raise serializers.ValidationError({name: f"Between {low} and {high}."})
    return value


def _log_source(request, job: Job) -> tuple[JobAttempt | None, int]:
    """The attempt and rank a logs request asks for: a 400 naming `attempt` or `rank` for one the job lacks."""
    started = job.attempts.filter(started_at__isnull=False)
    number = _query_int(request, "attempt", None, 1, 2**15 - 1)
    if number is None:
        attempt = started.order_by("-number").first()
    else:
        attempt = started.filter(number=number).first()
        if attempt is None:
            numbers = ", ".join(str(n) for n in started.order_by("number").values_list("number", flat=True))
            raise serializers.ValidationError(
                {"attempt": f"Job {job.id} has no started attempt {number}"
                            + (f"; its started attempts are {numbers}." if numbers else "; none has started yet.")})
    name = "rank" if nulls.query_param(request, "rank") not in (None, "") else "replica"
    ranks = job_selectors.attempt_ranks(job, attempt) if attempt else list(range(job.replicas))
    rank = _query_int(request, name, 0, 0, 2**15 - 1)
    if rank not in ranks:
        raise serializers.ValidationError({name: f"Between {ranks[0]} and {ranks[-1]}: the attempt's replicas."})
    return attempt, rank


def _unavailable(exc: Exception) -> Response:
    return Response({"detail": str(exc)}, status=status.HTTP_503_SERVICE_UNAVAILABLE, headers={"Retry-After": "5"})


def log_file_response(job: Job, attempt: int | None, rank: int, lines: list[str]) -> HttpResponse:
    """A replica's log lines as a text file the browser saves (the page's Download link answers the same)."""
    response = HttpResponse("".join(f"{line}\n" for line in lines), content_type="text/plain; charset=utf-8")
    name = f"{job.name}-{job.id}-attempt-{attempt or 0}-rank-{rank}.log"
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    return response


class FileNegotiation(BaseContentNegotiation):
    """The log download answers a text file whatever the client accepts, and its errors in JSON as
    everywhere else: no 406 for a client that asks for text/plain only."""

    def select_parser(self, request, parsers):
        return parsers[0]

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


# The file name a checkpoint download is saved under keeps the recorded file's suffix only when it is a plain
# one: the record is the job's own writing (a script's), so nothing else of it goes into a header.
PLAIN_SUFFIX = re.compile(r"\.[A-Za-z0-9]{1,12}")


def checkpoint_file_response(job: Job, step: int, opened) -> FileResponse | StreamingHttpResponse:
    """A checkpoint as a file the client saves: a file's bytes with its Content-Length, or a folder as a .tar.gz
    made while it streams (no Content-Length)."""
    if opened.is_folder:
        response = StreamingHttpResponse(opened.chunks, content_type="application/gzip")
        response["Content-Disposition"] = f'attachment; filename="{job.name}-{job.id}-step-{step}.tar.gz"'
        return response
    suffix = PurePosixPath(opened.name).suffix
    suffix = suffix if PLAIN_SUFFIX.fullmatch(suffix) else ".bin"
    return FileResponse(opened.stream, as_attachment=True, filename=f"{job.name}-{job.id}-step-{step}{suffix}",
                        content_type="application/octet-stream")


class JobViewSet(TenantScopedMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Training jobs of the caller's tenants: submit (member and up), read (viewers too), cancel, logs, metrics."""

    # A read's nested lists come as plain rows, one query per relation for the page (get_serializer);
    # the answers of a submit and a cancel read them through the job's relations, three queries too.
    queryset = Job.objects.select_related("tenant", "flavor", "submitted_by")
    NESTED = {relation: (serializer.Meta.model, serializer.Meta.fields) for relation, serializer in (
        ("attempts", JobAttemptSerializer), ("checkpoints", CheckpointSerializer), ("events", JobEventSerializer))}
    serializer_class = JobSerializer
    filterset_class = JobFilter
    lookup_value_regex = r"[0-9]+"
    # What a read (list, retrieve) loads and never shows: the reconcile's bookkeeping and the submitter's
    # account beyond the username. The other actions work on the job, so they load all of it.
    READS_DEFER = ("progress_cursor", "reconcile_errors", "reconcile_after", "reconcile_error", "state_changed_at",
                   *(f"submitted_by__{name}" for name in ("password", "last_login", "is_superuser", "first_name",
                                                          "last_name", "email", "date_joined")))

    def refine_queryset(self, queryset):
        if self.action == "list":
            # The caller's tenant (the one asked for, or each of theirs) as constants, besides the scoping's
            # subquery: PostgreSQL then reads a page of a tenant's newest jobs off the job_tenant_newest
            # index instead of sorting every job the tenant ever ran (0.2 ms against about 100 ms at 50,000).
            slug = self.request.query_params.get("tenant")
            if slug or not self.request.user.is_staff:
                tenants = tenant_list(user=self.request.user)
                tenants = tenants.filter(slug=slug) if slug else tenants
                queryset = queryset.filter(tenant_id__in=list(tenants.values_list("id", flat=True)))
        return queryset.defer(*self.READS_DEFER) if self.action in ("list", "retrieve") else queryset

    def get_serializer(self, *args, **kwargs):
        if self.action in ("list", "retrieve") and args:
            listed = list(args[0]) if kwargs.get("many") else [args[0]]
            attach_nested_rows(listed, self.NESTED)
            args = (listed if kwargs.get("many") else listed[0], *args[1:])
        return super().get_serializer(*args, **kwargs)

    @extend_schema(
        request=JobSubmitSerializer,
        parameters=[OpenApiParameter(
            "Idempotency-Key", str, location=OpenApiParameter.HEADER, required=False,
            description="Retry safely: the same key and body within a day answer the job the first request made "
                        "(200), never a second job; the same key with another body is a 400.",
        ), OpenApiParameter(
            "Retry-After", int, location=OpenApiParameter.HEADER, response=[429],
            description="Seconds until the next scheduling cycle, which may start some of the waiting jobs.",
        )],
        responses={201: JobSerializer, 200: JobSerializer, 429: OpenApiResponse(
            response=inline_serializer("QueuedBudgetReached", {"detail": serializers.CharField()}),
            description="The tenant already has JOB_QUEUED_MAX_PER_TENANT jobs waiting; nothing was saved. Try "
                        "again after the number of seconds in Retry-After, or once some have started.",
        ), 404: OpenApiResponse(
            response=inline_serializer("UnknownBundle", {
                "bundle": serializers.ListField(child=serializers.CharField(), required=False),
                "datasets": serializers.ListField(child=serializers.CharField(), required=False)}),
            description="A script job's bundle is not one of the tenant's (no such digest, deleted, or another "
                        "tenant's: the same answer), or a dataset or version it names is not one the tenant reads "
                        "(field datasets); nothing was saved.",
        )},
    )
    def create(self, request):
        # The answer is built inside the transaction that writes the job: once it commits, nothing
        # is left to read that could fail and turn a created job into an error for the client.
        try:
            with transaction.atomic():
                job, created = jobs.job_submit_keyed(
                    actor=request.user, data=request.data, idempotency_key=request.headers.get("Idempotency-Key"),
                )
                data = JobSerializer(self.get_queryset().get(id=job.id)).data
        except TooMany as exc:
            raise Throttled(detail=str(exc), wait=getattr(exc, "retry_after_s", None)) from exc
        except (jobs.UnknownBundle, UnknownDataset) as exc:
            # A reference to what the tenant does not have: a 404 (nothing stored), the same for another tenant's.
            return Response(exc.message_dict, status=status.HTTP_404_NOT_FOUND)
        return Response(data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(request=None, responses={202: JobSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk):
        with transaction.atomic():
            job = jobs.job_cancel(actor=request.user, job=self.get_object())
            data = JobSerializer(self.get_queryset().get(id=job.id)).data
        return Response(data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        parameters=[
            OpenApiParameter("rank", int, description="Which replica (rank) of the attempt; 0 unless given."),
            OpenApiParameter("replica", int, description="The same as rank (its older name); rank wins."),
            OpenApiParameter("attempt", int, description="Which attempt (its number); the newest that started unless "
                                                         "given. An earlier one's log is there while the cluster "
                                                         "keeps it."),
            OpenApiParameter("tail", int, description="How many of the last lines (1-5000, default 200)."),
        ],
        responses={200: JobLogsSerializer, 503: OpenApiResponse(description="The cluster cannot be read now.")},
    )
    @action(detail=True, methods=["get"])
    def logs(self, request, pk):
        """One replica's last lines, as it wrote them (the trainer's tagged progress lines included)."""
        job = self.get_object()
        attempt, rank = _log_source(request, job)
        tail = _query_int(request, "tail", 200, 1, 5000)
        try:
            text = job_selectors.job_log_tail(job, attempt.number, rank, tail=tail) if attempt else ""
        except job_selectors.BackendUnavailable as exc:
            return _unavailable(exc)
        return Response({"attempt": attempt.number if attempt else None, "replica": rank, "text": text})

    @extend_schema(
        operation_id="jobs_logs_download",
        parameters=[
            OpenApiParameter("rank", int, description="Which replica (rank) of the attempt; 0 unless given."),
            OpenApiParameter("attempt", int, description="Which attempt (its number); the newest that started unless "
                                                         "given."),
        ],
        responses={
            (200, "text/plain"): OpenApiResponse(
                OpenApiTypes.STR,
                description=f"The replica's log as a file (Content-Disposition: attachment), its last "
                            f"{job_selectors.LOG_DOWNLOAD_LINES} lines at most, without the trainer's progress lines; "
                            f"empty before the job started."),
            503: OpenApiResponse(description="The cluster cannot be read now."),
        },
    )
    @action(detail=True, methods=["get"], url_path="logs/download",
            content_negotiation_class=FileNegotiation)
    def logs_download(self, request, pk):
        """One replica's log as a text file, as a person reads it."""
        job = self.get_object()
        attempt, rank = _log_source(request, job)
        try:
            lines = job_selectors.job_log_lines(job, attempt.number, rank,
                                                tail=job_selectors.LOG_DOWNLOAD_LINES) if attempt else []
        except job_selectors.BackendUnavailable as exc:
            return _unavailable(exc)
        return log_file_response(job, attempt.number if attempt else None, rank, lines)

    @extend_schema(
        operation_id="jobs_checkpoint_download",
        parameters=[OpenApiParameter("step", int, location=OpenApiParameter.PATH, description="The checkpoint's step.")],
        responses={
            (200, "application/octet-stream"): OpenApiResponse(
                OpenApiTypes.BINARY,
                description="The checkpoint's file as it was written (Content-Length, Content-Disposition: "
                            "<job>-<id>-step-<step>.pt); a checkpoint that is a folder comes as a .tar.gz of it "
                            "(application/gzip, made while it streams: no Content-Length)."),
            404: OpenApiResponse(description="No such job for the caller, or the job has no checkpoint of that step "
                                             "(never written, or its file deleted): the body names `step`."),
            409: OpenApiResponse(description="The backend keeps checkpoints where the portal does not read them "
                                             "(Kubernetes: the environment's volume); the message says how to get it."),
            503: OpenApiResponse(description="The cluster cannot be read now."),
        },
    )
    @action(detail=True, methods=["get"], url_path=r"checkpoints/(?P<step>[0-9]+)/download",
            content_negotiation_class=FileNegotiation)
    def checkpoint_download(self, request, pk, step):
        """One of the job's recorded checkpoints as a file (viewers too)."""
        job = self.get_object()
        step = int(step)
        try:
            _checkpoint, opened = job_selectors.job_checkpoint_open(job, step)
        except job_selectors.CheckpointMissing as exc:
            return Response({"step": [str(exc)]}, status=status.HTTP_404_NOT_FOUND)
        except job_selectors.CheckpointNotHere as exc:
            raise Conflict(str(exc)) from None
        except job_selectors.BackendUnavailable as exc:
            return _unavailable(exc)
        return checkpoint_file_response(job, step, opened)

    @extend_schema(
        parameters=[
            OpenApiParameter("points", int, description=f"At most this many points, spread evenly over the steps "
                                                        f"(1-{job_selectors.MAX_SERIES_POINTS}, default 1000)."),
            OpenApiParameter("first_step", int, description="Only steps from this one on (zoom in)."),
            OpenApiParameter("last_step", int, description="Only steps up to this one."),
        ],
        responses={200: JobMetricsSerializer},
    )
    @action(detail=True, methods=["get"])
    def metrics(self, request, pk):
        """The loss curve as the reconcile recorded it: downsampled, so a long run costs what a short one does."""
        job = self.get_object()
        points = _query_int(request, "points", 1000, 1, job_selectors.MAX_SERIES_POINTS)
        first = _query_int(request, "first_step", None, 0, 2**31 - 1)
        last = _query_int(request, "last_step", None, 0, 2**31 - 1)
        found = job_selectors.job_metric_series(job, points=points, first_step=first, last_step=last)
        return Response(found)
