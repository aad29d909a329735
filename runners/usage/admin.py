"""Utilization, usage and cost in the Django admin, read-only: the ledger is append-only, and budgets
and cloud reference prices are set through the API (which checks them)."""

from django.contrib import admin

from common.admin import ReadOnlyAdmin
from runners.usage.models import Budget, BudgetAlert, CloudPrice, UsageEntry, UtilizationSample


@admin.register(UsageEntry)
class UsageEntryAdmin(ReadOnlyAdmin):
    list_display = ["day", "tenant", "kind", "flavor", "job", "endpoint", "gpu_seconds", "gb_seconds", "cost",
                    "currency", "correction", "recorded_at"]
    list_filter = ["kind", "correction", "tenant", "flavor"]
    date_hierarchy = "day"


@admin.register(UtilizationSample)
class UtilizationSampleAdmin(ReadOnlyAdmin):
    list_display = ["at", "tenant", "job", "attempt", "rank", "device", "resolution", "source", "gpu_util_pct",
                    "memory_used_mib", "power_w"]
    list_filter = ["resolution", "source", "tenant"]


@admin.register(CloudPrice)
class CloudPriceAdmin(ReadOnlyAdmin):
    list_display = ["flavor", "price_per_hour", "currency", "provider", "effective_from"]


@admin.register(Budget)
class BudgetAdmin(ReadOnlyAdmin):
    list_display = ["tenant", "monthly_amount", "currency", "stop_borrowing", "updated_at"]


@admin.register(BudgetAlert)
class BudgetAlertAdmin(ReadOnlyAdmin):
    list_display = ["tenant", "month", "threshold", "spent", "budget", "currency", "at"]
