from django.contrib import admin

from common.admin import ReadOnlyAdmin
from runners.registry.models import ModelVersion


@admin.register(ModelVersion)
class ModelVersionAdmin(ReadOnlyAdmin):
    list_display = ["name", "version", "tenant", "step", "source_job", "weights_bytes", "created_at"]
    list_filter = ["tenant"]
    search_fields = ["name", "tenant__slug", "weights_sha256"]
