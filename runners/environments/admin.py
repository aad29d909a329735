"""The Django admin's view of environments, read-only: requesting, provisioning and deleting one go
through the services (a delete here would leave its namespace, or its workspace, behind)."""

from django.contrib import admin

from common.admin import ReadOnlyAdmin
from runners.environments.models import Environment


@admin.register(Environment)
class EnvironmentAdmin(ReadOnlyAdmin):
    list_display = ["namespace", "tenant", "state", "backend", "state_changed_at", "task_runs"]
    list_filter = ["state", "backend", "tenant"]
    search_fields = ["name", "namespace"]
