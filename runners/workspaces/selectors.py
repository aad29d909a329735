"""Reads of workspaces, with their visibility rule: a workspace is its owner's; the tenant's members see it
where the owner shares it, its admins and owners always (they may stop it); staff see every one."""

from django.db.models import Q, QuerySet

from runners.workspaces.models import Workspace
from tenants.models import Membership, Role


def visible(queryset: QuerySet, user) -> QuerySet:
    """``queryset`` (already scoped to the user's tenants) cut to the workspaces ``user`` may see."""
    if user.is_staff:
        return queryset
    admin_of = Membership.objects.filter(user=user, role__in=[Role.OWNER, Role.ADMIN]).values("tenant_id")
    member_of = Membership.objects.filter(user=user).exclude(role=Role.VIEWER).values("tenant_id")
    return queryset.filter(Q(owner=user) | Q(tenant_id__in=admin_of) | Q(shared=True, tenant_id__in=member_of))


def workspace_list(*, user, tenant=None) -> QuerySet:
    from tenants.selectors import tenant_list

    queryset = Workspace.objects.filter(tenant__in=tenant_list(user=user)).select_related(
        "tenant", "environment", "flavor", "owner", "job")
    if tenant is not None:
        queryset = queryset.filter(tenant=tenant)
    return visible(queryset, user)
