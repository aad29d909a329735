"""The audit log in the Django admin: read, filter and search; nothing here adds, changes or deletes an entry."""

from django.contrib import admin

from audit.models import AuditEntry
from common.admin import ReadOnlyAdmin


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = ["at", "actor_name", "tenant_slug", "action", "object_type", "object_id", "object_repr"]
    list_filter = ["action", "object_type"]
    search_fields = ["actor_name", "tenant_slug", "action", "object_repr", "request_id"]
    date_hierarchy = "at"
    # The keys point at rows that may be gone (a deleted user or tenant): show the names written down instead.
    exclude = ["actor", "tenant"]
