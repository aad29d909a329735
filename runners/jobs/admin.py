"""The Django admin's view of jobs and their rows, read-only: a job changes only through runners.jobs
(submit, cancel, the cycle), and deleting one here would leave its processes or pods unseen."""

from django.contrib import admin

from common.admin import ReadOnlyAdmin
from runners.jobs.models import Checkpoint, CheckpointHandover, IdempotencyKey, Job, JobAttempt, JobEvent, JobMetric


class JobAttemptInline(admin.TabularInline):
    model = JobAttempt
    extra = 0
    can_delete = False
    fields = readonly_fields = [
        "number", "placement", "admitted_at", "started_at", "ended_at", "outcome", "exit_code", "reason", "resumed_from_step",
        "stop_recorded_at",
    ]


class JobEventInline(admin.TabularInline):
    model = JobEvent
    extra = 0
    can_delete = False
    fields = readonly_fields = ["at", "from_state", "to_state", "reason"]


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    list_display = ["id", "name", "tenant", "state", "flavor", "replicas", "gpus_per_replica", "priority", "submitted_at"]
    list_filter = ["state", "tenant", "flavor"]
    search_fields = ["name"]
    inlines = [JobAttemptInline, JobEventInline]


@admin.register(JobAttempt)
class JobAttemptAdmin(ReadOnlyAdmin):
    list_display = ["job", "number", "admitted_at", "started_at", "ended_at", "outcome", "exit_code"]
    list_filter = ["outcome"]
    search_fields = ["job__name"]


@admin.register(Checkpoint)
class CheckpointAdmin(ReadOnlyAdmin):
    list_display = ["job", "step", "bytes", "store_state", "stored_bytes", "durable_at", "created_at", "uri"]
    list_filter = ["store_state"]
    search_fields = ["job__name"]


@admin.register(CheckpointHandover)
class CheckpointHandoverAdmin(ReadOnlyAdmin):
    list_display = ["checkpoint", "bytes", "handed_at"]


@admin.register(JobMetric)
class JobMetricAdmin(ReadOnlyAdmin):
    list_display = ["job", "attempt", "step", "loss", "samples_per_s"]
    search_fields = ["job__name"]
    show_full_result_count = False  # a long run records millions of steps


@admin.register(JobEvent)
class JobEventAdmin(ReadOnlyAdmin):
    list_display = ["job", "at", "from_state", "to_state", "reason"]
    list_filter = ["to_state"]
    search_fields = ["job__name"]


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(ReadOnlyAdmin):
    list_display = ["key", "user", "job", "created_at"]
    search_fields = ["key"]
