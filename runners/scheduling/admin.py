"""The scheduling cycle's figures and the moves it made, in the Django admin, read-only."""

from django.contrib import admin

from common.admin import ReadOnlyAdmin
from runners.scheduling.models import JobMove, SchedulerCycle


@admin.register(SchedulerCycle)
class SchedulerCycleAdmin(ReadOnlyAdmin):
    list_display = ["id", "runs", "last_started_at", "last_duration_ms", "last_admitted", "last_preempted", "last_waiting"]


@admin.register(JobMove)
class JobMoveAdmin(ReadOnlyAdmin):
    list_display = ["at", "job", "for_job", "flavor", "from_node", "to_node", "units", "cost_s", "gain"]
    list_filter = ["flavor"]
    search_fields = ["job__name", "for_job__name"]
