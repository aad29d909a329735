"""What every app's Django admin shares: a read-only view for rows that only services may write."""

from django.contrib import admin


class ReadOnlyAdmin(admin.ModelAdmin):
    """Look, filter and search; no add, change or delete here: these rows change only through the
    portal's services (their checks, signals and the work they send), never by hand."""

    actions = None  # no "delete selected"

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
