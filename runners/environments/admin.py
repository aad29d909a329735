"""The Django admin's view of environments (read-mostly: state changes go through the services)."""

from django.contrib import admin

from runners.environments.models import Environment


@admin.register(Environment)
class EnvironmentAdmin(admin.ModelAdmin):
    list_display = ["namespace", "tenant", "state", "backend", "state_changed_at", "task_runs"]
    list_filter = ["state", "backend", "tenant"]
    search_fields = ["name", "namespace"]
    readonly_fields = ["namespace", "backend", "state", "status_message", "created_at", "state_changed_at", "task_runs"]
