"""Datasets in the Django admin, read-only: they are pushed, registered, sealed and shared through the API."""

from django.contrib import admin

from common.admin import ReadOnlyAdmin
from runners.datasets.models import Dataset, DatasetShare, DatasetUse, DatasetVersion


@admin.register(Dataset)
class DatasetAdmin(ReadOnlyAdmin):
    list_display = ["tenant", "name", "created_by", "created_at"]
    list_filter = ["tenant"]
    search_fields = ["name"]


@admin.register(DatasetVersion)
class DatasetVersionAdmin(ReadOnlyAdmin):
    list_display = ["dataset", "number", "state", "shards", "bytes", "files", "source", "created_at", "sealed_at"]
    list_filter = ["state"]
    search_fields = ["dataset__name"]


@admin.register(DatasetShare)
class DatasetShareAdmin(ReadOnlyAdmin):
    list_display = ["dataset", "tenant", "created_by", "created_at"]


@admin.register(DatasetUse)
class DatasetUseAdmin(ReadOnlyAdmin):
    list_display = ["version", "tenant", "job_id", "job_name", "created_at", "read_at"]
