"""Reads of tenant data, always scoped to the user who asks."""

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet

from common.errors import NotFound
from tenants.models import Membership, Tenant, TokenInfo, role_at_least


def tenant_list(*, user: AbstractBaseUser) -> QuerySet[Tenant]:
    """Tenants the user belongs to; staff see all of them."""
    if not user.is_authenticated:
        return Tenant.objects.none()
    if user.is_staff:
        return Tenant.objects.all()
    return Tenant.objects.filter(memberships__user=user)


def tenant_get(*, user: AbstractBaseUser, slug: str) -> Tenant:
    """One of the user's tenants; anyone else's is a 404, never a 403."""
    try:
        return tenant_list(user=user).get(slug=slug)
    except Tenant.DoesNotExist:
        raise NotFound("No such tenant.") from None


def membership_get(*, user: AbstractBaseUser, tenant: Tenant) -> Membership | None:
    if not user.is_authenticated:
        return None
    return Membership.objects.filter(user=user, tenant=tenant).first()


def user_role(*, user: AbstractBaseUser, tenant: Tenant) -> str | None:
    """The user's role in the tenant; staff act as owners everywhere."""
    if user.is_authenticated and user.is_staff:
        return "owner"
    membership = membership_get(user=user, tenant=tenant)
    return membership.role if membership else None


def member_list(*, user: AbstractBaseUser, tenant: Tenant) -> QuerySet[Membership]:
    tenant_get(user=user, slug=tenant.slug)  # re-checks scope; raises 404 for outsiders
    return Membership.objects.filter(tenant=tenant).select_related("user").order_by("user__username")


def user_has_role(*, user: AbstractBaseUser, tenant: Tenant, at_least: str) -> bool:
    """Whether the user holds at least this role in the tenant (staff hold every role)."""
    return role_at_least(user_role(user=user, tenant=tenant), at_least)


def token_list(*, user: AbstractBaseUser, owner: str | None = None) -> QuerySet[TokenInfo]:
    """The user's own API tokens, newest first; staff may ask for another user's (`owner`)."""
    tokens = TokenInfo.objects.select_related("token", "token__user")
    if owner is not None and user.is_staff:
        return tokens.filter(token__user__username=owner)
    return tokens.filter(token__user=user)


def token_get(*, user: AbstractBaseUser, token_id: int) -> TokenInfo:
    """One of the user's tokens (staff: anyone's); any other is NotFound."""
    tokens = TokenInfo.objects.select_related("token", "token__user")
    info = (tokens if user.is_staff else tokens.filter(token__user=user)).filter(id=token_id).first()
    if info is None:
        raise NotFound("No such token.")
    return info
