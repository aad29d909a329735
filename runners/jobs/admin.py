"""The Django admin's view of jobs, read-only."""

from django.contrib import admin

from runners.jobs.models import Job, JobAttempt, JobEvent


class JobAttemptInline(admin.TabularInline):
    model = JobAttempt
    extra = 0
    can_delete = False
    fields = readonly_fields = [
        "number", "placement", "admitted_at", "started_at", "ended_at", "outcome", "exit_code", "reason", "resumed_from_step",
    ]


class JobEventInline(admin.TabularInline):
    model = JobEvent
    extra = 0
    can_delete = False
    fields = readonly_fields = ["at", "from_state", "to_state", "reason"]


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    """Read-only: a job's state changes only through runners.jobs (submit, cancel, the cycle)."""

    list_display = ["id", "name", "tenant", "state", "flavor", "replicas", "gpus_per_replica", "priority", "submitted_at"]
    list_filter = ["state", "tenant", "flavor"]
    search_fields = ["name"]
    inlines = [JobAttemptInline, JobEventInline]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
