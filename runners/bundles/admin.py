"""Code bundles in the Django admin, read-only: they are uploaded and deleted through the API."""

from django.contrib import admin

from common.admin import ReadOnlyAdmin
from runners.bundles.models import Bundle


@admin.register(Bundle)
class BundleAdmin(ReadOnlyAdmin):
    list_display = ["tenant", "sha256", "size_bytes", "unpacked_bytes", "files", "has_requirements", "created_by",
                    "created_at", "last_used_at", "deleted_at"]
    list_filter = ["tenant"]
    search_fields = ["sha256"]
