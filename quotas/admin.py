"""Flavors, prices and quotas in the Django admin, read-only: the quota page and the API change them,
through services that check them and tell the environments (quota_changed)."""

from django.contrib import admin

from common.admin import ReadOnlyAdmin
from quotas.models import BorrowingPause, GuaranteeReduction, PriceCard, Quota, ResourceFlavor, TenantStorage


@admin.register(ResourceFlavor)
class ResourceFlavorAdmin(ReadOnlyAdmin):
    list_display = ["name", "kind", "gpu_model", "mig_profile", "capacity", "capacity_updated_at"]
    list_filter = ["kind", "gpu_model"]
    search_fields = ["name"]


@admin.register(PriceCard)
class PriceCardAdmin(ReadOnlyAdmin):
    list_display = ["flavor", "price_per_hour", "currency", "effective_from", "created_at"]
    list_filter = ["flavor", "currency"]


@admin.register(Quota)
class QuotaAdmin(ReadOnlyAdmin):
    list_display = ["tenant", "flavor", "guaranteed", "max", "fair_share_weight", "max_priority", "updated_at"]
    list_filter = ["tenant", "flavor"]


@admin.register(GuaranteeReduction)
class GuaranteeReductionAdmin(ReadOnlyAdmin):
    list_display = ["tenant", "flavor", "guaranteed_before", "guaranteed_after", "created_by", "created_at", "reason"]
    list_filter = ["tenant", "flavor"]


@admin.register(BorrowingPause)
class BorrowingPauseAdmin(ReadOnlyAdmin):
    list_display = ["tenant", "since", "reason"]


@admin.register(TenantStorage)
class TenantStorageAdmin(ReadOnlyAdmin):
    list_display = ["tenant", "quota_gb", "retention", "updated_at"]
