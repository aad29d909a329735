"""Tenants, members and API tokens in the Django admin. Members and tokens are shown, not changed:
the tenant page and the API change them through services that tell the environments
(members_changed) and keep a token's secret out of sight."""

from django.contrib import admin
from django.db import transaction

from common.admin import ReadOnlyAdmin
from tenants.models import Membership, Tenant, TokenInfo
from tenants.signals import audited


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    can_delete = False
    fields = readonly_fields = ["user", "role", "created_at"]

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "created_at"]
    search_fields = ["slug", "name"]
    inlines = [MembershipInline]
    actions = None  # a tenant's environments and jobs go with it: delete one at a time, knowingly

    # Changes made here go into the audit log like those the services make, in the same transaction.
    def save_model(self, request, obj, form, change):
        before = None
        if change:
            before = Tenant.objects.filter(pk=obj.pk).values("slug", "name").first()
        with transaction.atomic():
            super().save_model(request, obj, form, change)
            audited("tenant.updated" if change else "tenant.created", actor=request.user, tenant=obj, obj=obj,
                    before=before, after={"slug": obj.slug, "name": obj.name})

    def delete_model(self, request, obj):
        with transaction.atomic():
            audited("tenant.deleted", actor=request.user, tenant=obj, obj=obj, before={"slug": obj.slug, "name": obj.name})
            super().delete_model(request, obj)


@admin.register(Membership)
class MembershipAdmin(ReadOnlyAdmin):
    list_display = ["user", "tenant", "role", "created_at"]
    list_filter = ["role", "tenant"]
    search_fields = ["user__username", "tenant__slug"]


@admin.register(TokenInfo)
class TokenInfoAdmin(ReadOnlyAdmin):
    list_display = ["name", "user", "created", "expiry", "last_used_at"]
    search_fields = ["name", "token__user__username"]

    @admin.display(ordering="token__user__username")
    def user(self, info):
        return info.token.user

    @admin.display(ordering="token__created")
    def created(self, info):
        return info.token.created

    @admin.display(ordering="token__expiry")
    def expiry(self, info):
        return info.token.expiry
