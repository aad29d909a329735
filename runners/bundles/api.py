"""REST API of code bundles, under a tenant: upload (multipart, the file field ``archive``), list, get, delete.

Members upload and delete (any role but viewer), every member reads; anyone else gets 404. An upload
is streamed to a temporary file and read no further than any archive within the limits can be;
past that, or past BUNDLE_MAX_BYTES unpacked, the answer is a 413 naming the limit and the largest
files. A member no bundle may hold is a 400: ``{"archive": ["<member>: <why>"]}``.
"""

from django.core.files.uploadhandler import TemporaryFileUploadHandler
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema, inline_serializer
from gpuportal.bundle import BundleError, BundleTooLarge
from rest_framework import exceptions, serializers, status, viewsets
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter

from runners.bundles import services
from runners.bundles.models import Bundle
from tenants.models import Role
from tenants.scoping import TenantScopedMixin
from tenants.selectors import tenant_get
from tenants.services import require_role


class BundleSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugField(source="tenant.slug", read_only=True)
    created_by = serializers.CharField(source="created_by.username", read_only=True, allow_null=True, default=None)

    class Meta:
        model = Bundle
        fields = ["sha256", "tenant", "size_bytes", "unpacked_bytes", "files", "has_requirements", "created_at",
                  "created_by", "last_used_at"]


class TooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "The bundle is too large."
    default_code = "bundle_too_large"


class BoundedUploadHandler(TemporaryFileUploadHandler):
    """Streams uploaded files to temporary files, and stops reading once more than ``limit`` bytes came:
    a 413 naming the largest files of what came (TooLarge, wherever the body is being read)."""

    def __init__(self, request=None, *, limit: int):
        super().__init__(request)
        self.limit = limit
        self.received = 0

    def receive_data_chunk(self, raw_data, start):
        self.received += len(raw_data)
        self.file.write(raw_data)
        if self.received > self.limit:
            self.file.flush()
            raise TooLarge(services.too_large_message(services.largest_seen(self.file)))
        return None

    def close(self) -> None:
        """Remove the temporary file still being written (one completed is the request's, closed with it)."""
        if getattr(self, "file", None) is not None:
            self.file.close()


UPLOAD_FIELDS = {"archive"}
_PROBLEM = inline_serializer("BundleProblem", fields={"detail": serializers.CharField()})


class BundleViewSet(TenantScopedMixin, viewsets.GenericViewSet):
    """A tenant's code bundles, by content digest (SHA-256)."""

    queryset = Bundle.objects.select_related("tenant", "created_by").filter(deleted_at__isnull=True)
    serializer_class = BundleSerializer
    parser_classes = [MultiPartParser]
    lookup_field = "sha256"
    lookup_value_regex = r"[0-9a-f]{64}"

    def initialize_request(self, request, *args, **kwargs):
        # Before anything reads the body (for a session's POST, the CSRF check reads the form).
        if request.method == "POST":
            self.upload_handler = BoundedUploadHandler(request, limit=services.upload_bound())
            request.upload_handlers = [self.upload_handler]
        return super().initialize_request(request, *args, **kwargs)

    def finalize_response(self, request, response, *args, **kwargs):
        handler = getattr(self, "upload_handler", None)
        if handler is not None:
            handler.close()
        return super().finalize_response(request, response, *args, **kwargs)

    def tenant(self):
        return tenant_get(user=self.request.user, slug=self.kwargs["tenant_slug"])

    def refine_queryset(self, queryset):
        return queryset.filter(tenant=self.tenant()).order_by("-created_at", "-id")

    def list(self, request, tenant_slug):
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(self.get_serializer(page, many=True).data)

    def retrieve(self, request, tenant_slug, sha256):
        return Response(self.get_serializer(get_object_or_404(self.get_queryset(), sha256=sha256)).data)

    @extend_schema(
        request={"multipart/form-data": inline_serializer("BundleUpload", {"archive": serializers.FileField(
            help_text="The project folder as a .tar.gz (gpuportal's pack, or `tar czf - -C folder .`).")})},
        responses={
            201: BundleSerializer, 200: BundleSerializer,
            (413, "application/json"): OpenApiResponse(_PROBLEM, description=(
                "Larger than BUNDLE_MAX_BYTES unpacked (or a body past any archive within the limits): the detail "
                "names the limit and the largest files.")),
            (415, "application/json"): OpenApiResponse(_PROBLEM, description="The body is not multipart/form-data."),
        },
        examples=[OpenApiExample("A hostile member", value={"archive": ["../etc/passwd: has '..' in its path, "
                                                                         "which could reach outside the bundle"]},
                                 response_only=True, status_codes=["400"])],
    )
    def create(self, request, tenant_slug):
        """Upload a bundle: 201 when new, 200 (the same body) when these files are already kept."""
        tenant = self.tenant()  # 404 outside the tenant, before the body is read
        require_role(user=request.user, tenant=tenant, at_least=Role.MEMBER)  # 403 for viewers
        data, files = request.data, request.FILES  # a 413 past upload_bound(), read no further
        unknown = sorted((set(data) | set(files)) - UPLOAD_FIELDS)
        if unknown:
            raise serializers.ValidationError({unknown[0]: ["Unknown field; the one field is archive (a file)."]})
        archive = files.get("archive")
        if archive is None:
            raise serializers.ValidationError({"archive": ["No file was sent: send the .tar.gz as the file "
                                                           "field archive (multipart/form-data)."]})
        try:
            bundle, created = services.store(tenant, request.user, archive.file)
        except BundleTooLarge as exc:
            raise TooLarge(services.too_large_message(exc.largest)) from None
        except BundleError as exc:
            raise serializers.ValidationError({"archive": [str(exc)]}) from None
        return Response(BundleSerializer(bundle).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(responses={204: None, (409, "application/json"): OpenApiResponse(
        _PROBLEM, description="Queued or running jobs use the bundle: the detail names them.")})
    def destroy(self, request, tenant_slug, sha256):
        """Delete a bundle (members); 409 naming the jobs while queued or running jobs use it."""
        bundle = get_object_or_404(self.get_queryset(), sha256=sha256)
        require_role(user=request.user, tenant=bundle.tenant, at_least=Role.MEMBER)
        services.delete(bundle, actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


# Included under /api/v1/ by portal/urls.py.
router = SimpleRouter()
router.register(r"tenants/(?P<tenant_slug>[a-z0-9-]+)/bundles", BundleViewSet, basename="tenant-bundle")
