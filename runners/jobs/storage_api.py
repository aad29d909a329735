"""REST API of a tenant's checkpoint storage: ``/api/v1/tenants/<slug>/storage/``.

Every member reads the quota, the store's bytes after deduplication and the retention policy; the
tenant's admins and owners change the retention policy, staff the quota. ``.../storage/preview/`` answers
what a proposed policy would delete and free now, before anything is saved. Anyone else gets 404.
"""

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from quotas.storage_services import UNCHANGED, tenant_storage_set
from runners.jobs import storage_selectors
from tenants.selectors import tenant_get


class PolicySerializer(serializers.Serializer):
    keep_newest = serializers.IntegerField(allow_null=True, help_text="Keep the N checkpoints of the highest steps.")
    keep_best = serializers.IntegerField(allow_null=True, help_text="Keep the M with the best (lowest) loss.")
    keep_every = serializers.IntegerField(allow_null=True, help_text="Keep every K-th checkpoint a job wrote.")
    metric = serializers.CharField()
    smaller_is_better = serializers.BooleanField()


class StorageSerializer(serializers.Serializer):
    tenant = serializers.CharField()
    quota_gb = serializers.DecimalField(max_digits=12, decimal_places=3, allow_null=True,
                                        help_text="GB (10^9 bytes) of the store after deduplication; null: no limit.")
    quota_bytes = serializers.IntegerField(allow_null=True)
    used_bytes = serializers.IntegerField(help_text="The store's bytes the tenant's checkpoints hold, each chunk once.")
    durable_checkpoints = serializers.IntegerField()
    durable_file_bytes = serializers.IntegerField(help_text="Those checkpoints' file sizes, before deduplication.")
    retention = PolicySerializer(allow_null=True, help_text="Null keeps everything.")
    can_set_retention = serializers.BooleanField()
    can_set_quota = serializers.BooleanField()
    updated_at = serializers.DateTimeField(allow_null=True)


class StorageUpdateSerializer(serializers.Serializer):
    # Checked by the service (quotas.storage_services), which names the field of a bad value.
    quota_gb = serializers.JSONField(required=False, allow_null=True, help_text="Staff only. GB, or null for no limit.")
    retention = serializers.JSONField(required=False, allow_null=True, help_text="Admins and owners. {keep_newest, keep_best, "
                                                                "keep_every}, each a count or null; null keeps all.")


class PreviewSerializer(serializers.Serializer):
    retention = serializers.JSONField(allow_null=True, help_text="The proposed policy; null keeps everything.")
    job = serializers.IntegerField(required=False, allow_null=True, min_value=1,
                                   help_text="Preview it as this job's own policy; else as the tenant's.")


PreviewAnswer = inline_serializer("RetentionPreview", fields={
    "policy": PolicySerializer(),
    "job": serializers.IntegerField(allow_null=True),
    "checkpoints": serializers.IntegerField(help_text="How many checkpoints it would delete."),
    "bytes_freed": serializers.IntegerField(help_text="What the tenant's store would drop by (after dedup)."),
    "file_bytes": serializers.IntegerField(help_text="Those checkpoints' file sizes, before deduplication."),
    "stored_bytes": serializers.IntegerField(help_text="What the tenant's store holds now."),
    "jobs": inline_serializer("RetentionPreviewJob", fields={
        "job": serializers.IntegerField(), "name": serializers.CharField(),
        "steps": serializers.ListField(child=serializers.IntegerField()),
        "file_bytes": serializers.IntegerField()}, many=True),
})


class StorageView(APIView):
    @extend_schema(responses=StorageSerializer)
    def get(self, request, tenant_slug):
        """The tenant's checkpoint storage: quota, bytes stored after deduplication, retention policy."""
        tenant = tenant_get(user=request.user, slug=tenant_slug)
        return Response(storage_selectors.storage_summary(user=request.user, tenant=tenant))

    @extend_schema(request=StorageUpdateSerializer, responses=StorageSerializer)
    def patch(self, request, tenant_slug):
        """Change the retention policy (admins, owners) or the quota (staff); a field left out keeps its value."""
        tenant = tenant_get(user=request.user, slug=tenant_slug)
        body = StorageUpdateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        tenant_storage_set(actor=request.user, tenant=tenant,
                           quota_gb=body.validated_data.get("quota_gb", UNCHANGED),
                           retention_policy=body.validated_data.get("retention", UNCHANGED))
        return Response(storage_selectors.storage_summary(user=request.user, tenant=tenant))


class StoragePreviewView(APIView):
    @extend_schema(request=PreviewSerializer, responses=PreviewAnswer)
    def post(self, request, tenant_slug):
        """What a proposed retention policy would delete and free now; nothing is saved."""
        tenant = tenant_get(user=request.user, slug=tenant_slug)
        body = PreviewSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        return Response(storage_selectors.retention_preview(
            user=request.user, tenant=tenant, policy=body.validated_data["retention"],
            job_id=body.validated_data.get("job")))
