from django.contrib import admin

from tenants.models import Environment, Membership, Tenant


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "created_at"]
    search_fields = ["slug", "name"]
    inlines = [MembershipInline]


@admin.register(Environment)
class EnvironmentAdmin(admin.ModelAdmin):
    list_display = ["namespace", "tenant", "state", "backend", "state_changed_at", "task_runs"]
    list_filter = ["state", "backend", "tenant"]
    search_fields = ["name", "namespace"]
    readonly_fields = ["namespace", "backend", "state", "status_message", "created_at", "state_changed_at", "task_runs"]
