"""REST API of datasets, under a tenant: ``/api/v1/tenants/<slug>/datasets/...``.

Every member reads the tenant's datasets and those shared with it (a shared one is named by its bare name
when that is unambiguous, else ``?owner=<slug>``); anyone else gets 404. Members push and register versions
of their own tenant's datasets; admins share them. A push: open a version with the digest of its shard
list (an open version of the same list is answered again, so a cut push resumes), declare its shards (the
answer lists those the portal still lacks and how many bytes of each it has), PUT each missing shard's
bytes in parts at their offset (checked against the shard's sha256 once whole), then seal.

Every list (datasets, a dataset's versions, a version's shards and its file index) is paginated as the rest of
the API is (common/pagination.py): ``?page=`` and ``?page_size=``, answered as {count, next, previous, results}.
"""

from django.db import transaction
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.generics import GenericAPIView
from rest_framework.parsers import BaseParser
from rest_framework.response import Response
from rest_framework.views import APIView

from common.errors import Invalid
from runners.datasets import selectors, services
from runners.datasets.models import NAME_MAX, NAME_PATTERN, Dataset, DatasetVersion, VersionState
from tenants.models import Tenant

_PROBLEM = inline_serializer("DatasetProblem", fields={"detail": serializers.CharField()})
OWNER = OpenApiParameter("owner", str, description="The owning tenant's slug, for a dataset shared with this tenant "
                                                   "whose bare name is ambiguous.")


class VersionSerializer(serializers.Serializer):
    number = serializers.IntegerField()
    state = serializers.ChoiceField(choices=VersionState.choices)
    reason = serializers.CharField()
    source = serializers.CharField()
    shards = serializers.IntegerField()
    bytes = serializers.IntegerField()
    samples = serializers.IntegerField()
    files = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    sealed_at = serializers.DateTimeField(allow_null=True)


class UseSerializer(serializers.Serializer):
    job_id = serializers.IntegerField()
    job_name = serializers.CharField()
    created_at = serializers.DateTimeField()
    read_at = serializers.DateTimeField(allow_null=True)


class VersionDetailSerializer(VersionSerializer):
    dataset = serializers.CharField()
    jobs = UseSerializer(many=True)
    part_bytes = serializers.IntegerField(help_text="The most bytes one shard upload request may carry.")
    shard_max_bytes = serializers.IntegerField()


class DatasetSerializer(serializers.Serializer):
    name = serializers.CharField()
    reference = serializers.CharField(help_text="How this tenant names it: its name, or owner/name when shared with it.")
    owner = serializers.CharField()
    description = serializers.CharField()
    created_at = serializers.DateTimeField()
    latest_version = VersionSerializer(allow_null=True)
    shared_with = serializers.ListField(child=serializers.CharField(), help_text="Its own tenant's view only.")


class DatasetDetailSerializer(DatasetSerializer):
    versions = VersionSerializer(many=True)


def _version_data(version: DatasetVersion | None) -> dict | None:
    if version is None:
        return None
    return {field: getattr(version, field) for field in VersionSerializer().fields}


def _dataset_data(dataset: Dataset, tenant: Tenant, *, detail: bool = False) -> dict:
    own = dataset.tenant_id == tenant.id
    data = {"name": dataset.name, "reference": selectors.reference_of(dataset, tenant), "owner": dataset.tenant.slug,
            "description": dataset.description, "created_at": dataset.created_at,
            "latest_version": _version_data(selectors.latest_version(dataset)),
            "shared_with": sorted(dataset.shares.values_list("tenant__slug", flat=True)) if own else []}
    if detail:
        data["versions"] = [_version_data(version) for version in selectors.sealed_versions(dataset)]
    return data


def _reference(request, name: str) -> str:
    owner = request.query_params.get("owner")
    return f"{owner}/{name}" if owner else name


def _resolve(request, tenant_slug: str, name: str) -> tuple[Tenant, Dataset]:
    return selectors.dataset_get(user=request.user, tenant_slug=tenant_slug, reference=_reference(request, name))


def _version(tenant: Tenant, dataset: Dataset, number: int) -> DatasetVersion:
    """A sealed version; its own tenant also sees one still open or failed (its pushes and registrations)."""
    return selectors.version_get(dataset, number, sealed=dataset.tenant_id != tenant.id)


def _version_detail(version: DatasetVersion, tenant: Tenant) -> dict:
    return {**_version_data(version), "dataset": selectors.reference_of(version.dataset, tenant),
            "jobs": list(selectors.uses_of(version, [tenant]).values("job_id", "job_name", "created_at", "read_at")),
            "part_bytes": services.part_bytes(), "shard_max_bytes": services.shard_max_bytes()}


class DatasetCreateSerializer(serializers.Serializer):
    name = serializers.RegexField(rf"^{NAME_PATTERN}$", max_length=NAME_MAX)
    description = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")


class ListView(GenericAPIView):
    """A view whose GET answers one page of a list, with the API's pagination (DEFAULT_PAGINATION_CLASS).

    Its rows come from the datasets' selectors, scoped to the caller's tenant, not from a queryset of the view,
    so it has no filters of its own. One that also takes a POST names its body's serializer as serializer_class,
    which an OPTIONS request describes."""

    filter_backends = ()

    def page_of(self, rows, shape=lambda row: row) -> Response:
        """The page the request asks for of ``rows`` (a queryset or anything sliceable with a length), each
        row shaped by ``shape``."""
        return self.get_paginated_response([shape(row) for row in self.paginate_queryset(rows)])


class DatasetListView(ListView):
    serializer_class = DatasetCreateSerializer

    @extend_schema(responses=DatasetSerializer(many=True))
    def get(self, request, tenant_slug):
        """The datasets this tenant reads: its own and those shared with it, by owner then name."""
        tenant, datasets = selectors.dataset_list(user=request.user, tenant_slug=tenant_slug)
        return self.page_of(datasets, lambda dataset: _dataset_data(dataset, tenant))

    @extend_schema(request=DatasetCreateSerializer, responses={201: DatasetDetailSerializer})
    def post(self, request, tenant_slug):
        """Create an empty dataset (members); push or register its versions."""
        tenant, _ = selectors.dataset_list(user=request.user, tenant_slug=tenant_slug)
        body = DatasetCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        dataset = services.dataset_create(actor=request.user, tenant=tenant, **body.validated_data)
        return Response(_dataset_data(dataset, tenant, detail=True), status=status.HTTP_201_CREATED)


class DatasetDetailView(APIView):
    @extend_schema(parameters=[OWNER], responses=DatasetDetailSerializer)
    def get(self, request, tenant_slug, name):
        """One dataset and its sealed versions."""
        tenant, dataset = _resolve(request, tenant_slug, name)
        return Response(_dataset_data(dataset, tenant, detail=True))


class VersionOpenSerializer(serializers.Serializer):
    manifest_sha256 = serializers.RegexField(r"^[0-9a-f]{64}$", help_text="gpuportal.datasets.manifest_sha256 of the "
                                                                          "shard list to push.")


class VersionListView(ListView):
    serializer_class = VersionOpenSerializer

    @extend_schema(parameters=[OWNER], responses=VersionSerializer(many=True))
    def get(self, request, tenant_slug, name):
        """The dataset's sealed versions, newest first."""
        _tenant, dataset = _resolve(request, tenant_slug, name)
        return self.page_of(selectors.sealed_versions(dataset), _version_data)

    @extend_schema(request=VersionOpenSerializer, responses={201: VersionDetailSerializer, 200: VersionDetailSerializer})
    def post(self, request, tenant_slug, name):
        """Open a version to push (201), or the open one of this shard list, to resume its push (200)."""
        tenant, dataset = _resolve(request, tenant_slug, name)
        body = VersionOpenSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        version, created = services.version_open(actor=request.user, tenant=tenant, dataset=dataset,
                                                 manifest_sha256=body.validated_data["manifest_sha256"])
        return Response(_version_detail(version, tenant), status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


class VersionDetailView(APIView):
    @extend_schema(parameters=[OWNER], responses=VersionDetailSerializer)
    def get(self, request, tenant_slug, name, number):
        """One version (sealed; its own tenant also sees it open or failed) and the tenant's jobs that named it."""
        tenant, dataset = _resolve(request, tenant_slug, name)
        return Response(_version_detail(_version(tenant, dataset, number), tenant))

    @extend_schema(responses={204: None, 409: OpenApiResponse(_PROBLEM, description="The version is sealed: kept.")})
    def delete(self, request, tenant_slug, name, number):
        """Drop an open or failed version (members of its tenant)."""
        tenant, dataset = _resolve(request, tenant_slug, name)
        services.version_discard(actor=request.user, tenant=tenant, version=_version(tenant, dataset, number))
        return Response(status=status.HTTP_204_NO_CONTENT)


class ShardDeclareSerializer(serializers.Serializer):
    position = serializers.IntegerField(min_value=0)
    sha256 = serializers.RegexField(r"^[0-9a-f]{64}$")
    bytes = serializers.IntegerField(min_value=1)
    samples = serializers.IntegerField(min_value=0, default=0)


class ShardsDeclareSerializer(serializers.Serializer):
    shards = ShardDeclareSerializer(many=True, max_length=services.DECLARE_BATCH_MAX)


class MissingShardSerializer(serializers.Serializer):
    position = serializers.IntegerField()
    sha256 = serializers.CharField()
    bytes = serializers.IntegerField()
    received_bytes = serializers.IntegerField()


class ShardSerializer(serializers.Serializer):
    position = serializers.IntegerField()
    sha256 = serializers.CharField()
    bytes = serializers.IntegerField()
    samples = serializers.IntegerField()
    stored = serializers.BooleanField()


_MISSING = inline_serializer("DatasetShardsMissing", {"missing": MissingShardSerializer(many=True)})
_CONFLICT = OpenApiResponse(_PROBLEM, description="The version is sealed (it never changes), or the offset is not "
                                                  "what the portal has of the shard (the detail says which).")


class VersionShardsView(ListView):
    serializer_class = ShardsDeclareSerializer

    @extend_schema(parameters=[OWNER], responses=ShardSerializer(many=True))
    def get(self, request, tenant_slug, name, number):
        """The version's shards in order: sha256, bytes, samples, whether stored."""
        tenant, dataset = _resolve(request, tenant_slug, name)
        version = _version(tenant, dataset, number)
        return self.page_of(selectors.version_shards(version).values("position", "sha256", "bytes", "samples", "stored"))

    @extend_schema(request=ShardsDeclareSerializer, responses={200: _MISSING, 409: _CONFLICT})
    def post(self, request, tenant_slug, name, number):
        """Declare shards of an open version: the answer lists every shard it still lacks (what to upload)."""
        tenant, dataset = _resolve(request, tenant_slug, name)
        body = ShardsDeclareSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        missing = services.shards_declare(actor=request.user, tenant=tenant, version=_version(tenant, dataset, number),
                                          shards=[dict(item) for item in body.validated_data["shards"]])
        return Response({"missing": missing})


class RawBody(BaseParser):
    """The shard's bytes, left in the request's stream for the view to read in blocks."""

    media_type = "application/octet-stream"

    def parse(self, stream, media_type=None, parser_context=None):
        return {}


_RECEIVED = inline_serializer("DatasetShardReceived", {"sha256": serializers.CharField(),
                                                       "received_bytes": serializers.IntegerField(),
                                                       "stored": serializers.BooleanField()})


class ShardUploadView(APIView):
    parser_classes = [RawBody]

    @extend_schema(
        request={"application/octet-stream": OpenApiTypes.BINARY},
        parameters=[OpenApiParameter("offset", int, description="Where this part starts in the shard: the bytes the "
                                                                "portal has of it (declaring answers them).")],
        responses={200: _RECEIVED, 409: _CONFLICT},
    )
    def put(self, request, tenant_slug, name, number, sha256):
        """Upload a part of a declared shard at its offset; the last part stores the shard once its sha256 matches
        (a mismatch is a 400, and nothing of it is kept)."""
        tenant, dataset = _resolve(request, tenant_slug, name)
        version = _version(tenant, dataset, number)
        raw = request.query_params.get("offset", "0")
        if not raw.isdigit() or len(raw) > 15:
            raise Invalid("offset", "A whole number of bytes from 0.")
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        answer = services.shard_receive(actor=request.user, tenant=tenant, version=version, sha256=sha256,
                                        offset=int(raw), stream=request._request, length=length)
        return Response(answer)


class SealSerializer(serializers.Serializer):
    shards = serializers.IntegerField(min_value=1, help_text="How many shards the version holds (positions 0 to n-1).")


class VersionSealView(APIView):
    @extend_schema(request=SealSerializer, responses={200: VersionDetailSerializer, 409: _CONFLICT})
    def post(self, request, tenant_slug, name, number):
        """Seal the version once every declared shard is stored: from then on jobs read it and it never changes."""
        tenant, dataset = _resolve(request, tenant_slug, name)
        body = SealSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        version = services.version_seal(actor=request.user, tenant=tenant, version=_version(tenant, dataset, number),
                                        shards=body.validated_data["shards"])
        return Response(_version_detail(version, tenant))


class IndexEntrySerializer(serializers.Serializer):
    path = serializers.CharField()
    bytes = serializers.IntegerField()
    shard = serializers.IntegerField()


class IndexRows:
    """A version's file index as the paginator takes it: its length is the version's file count, and a slice
    reads the index from the slice's start, no further than its end."""

    def __init__(self, version: DatasetVersion):
        self.version = version

    def __len__(self) -> int:
        if self.version.state == VersionState.SEALED:
            return self.version.files  # written at the seal, from the shards' members
        # An open or failed version (its own tenant's view): the files of the shards stored so far.
        return sum(len(members or []) for members in
                   selectors.version_shards(self.version).values_list("members", flat=True))

    def __getitem__(self, bounds: slice) -> list[dict]:
        start, stop = bounds.start or 0, bounds.stop
        if stop is None or stop <= start:
            return []
        return selectors.version_index(self.version, offset=start, limit=stop - start)


class VersionIndexView(ListView):
    @extend_schema(parameters=[OWNER], responses=IndexEntrySerializer(many=True))
    def get(self, request, tenant_slug, name, number):
        """The version's files in order, each with the position of the shard that holds it."""
        tenant, dataset = _resolve(request, tenant_slug, name)
        return self.page_of(IndexRows(_version(tenant, dataset, number)))


class ShareSerializer(serializers.Serializer):
    tenant = serializers.SlugField(help_text="The tenant to share it with, read-only.")


class DatasetSharesView(APIView):
    @extend_schema(request=ShareSerializer, responses={201: DatasetDetailSerializer})
    def post(self, request, tenant_slug, name):
        """Share the dataset read-only with another tenant (admins of its tenant)."""
        tenant, dataset = _resolve(request, tenant_slug, name)
        body = ShareSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        services.dataset_share(actor=request.user, tenant=tenant, dataset=dataset, with_slug=body.validated_data["tenant"])
        return Response(_dataset_data(dataset, tenant, detail=True), status=status.HTTP_201_CREATED)


class DatasetShareView(APIView):
    @extend_schema(responses={204: None})
    def delete(self, request, tenant_slug, name, other):
        """Stop sharing it with that tenant (admins of its tenant)."""
        tenant, dataset = _resolve(request, tenant_slug, name)
        services.dataset_unshare(actor=request.user, tenant=tenant, dataset=dataset, with_slug=other)
        return Response(status=status.HTTP_204_NO_CONTENT)


class RegisterSerializer(serializers.Serializer):
    url = serializers.CharField(max_length=1000, help_text="s3://bucket/prefix/ or file:///folder/, under one of "
                                                           "DATASET_SOURCE_URLS.")


class DatasetRegisterView(APIView):
    @extend_schema(request=RegisterSerializer, responses={202: VersionDetailSerializer})
    def post(self, request, tenant_slug, name):
        """Register a new version from a storage URL: a worker packs, stores and seals it (or marks it failed)."""
        tenant, dataset = _resolve(request, tenant_slug, name)
        body = RegisterSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        with transaction.atomic():
            version = services.version_register(actor=request.user, tenant=tenant, dataset=dataset,
                                                url=body.validated_data["url"])
        return Response(_version_detail(version, tenant), status=status.HTTP_202_ACCEPTED)
