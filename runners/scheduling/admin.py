"""The scheduling cycle's figures in the Django admin, read-only."""

from django.contrib import admin

from common.admin import ReadOnlyAdmin
from runners.scheduling.models import SchedulerCycle


@admin.register(SchedulerCycle)
class SchedulerCycleAdmin(ReadOnlyAdmin):
    list_display = ["id", "runs", "last_started_at", "last_duration_ms", "last_admitted", "last_preempted", "last_waiting"]
