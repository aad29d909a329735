"""Reads of notifications, scoped to who asks: a member's own choices; webhooks and their log for owners."""

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet

from common.errors import NotAllowed, NotFound
from runners.notifications.models import EMAIL_DEFAULTS, Delivery, EventKind, Preference, Webhook
from tenants.models import Membership, Role, Tenant
from tenants.selectors import tenant_get, user_has_role


def preferences_of(*, user: AbstractBaseUser, tenant: Tenant) -> dict[str, bool]:
    """The member's mail choice for every event kind in the tenant, the default where none was made."""
    chosen = dict(Preference.objects.filter(user=user, tenant=tenant).values_list("event", "email"))
    return {kind: chosen.get(kind, EMAIL_DEFAULTS[kind]) for kind in EventKind.values}


def preference_tenants(*, user: AbstractBaseUser) -> QuerySet[Tenant]:
    """The tenants the user is a member of (choices are a member's: staff who are not members have none)."""
    if not user.is_authenticated:
        return Tenant.objects.none()
    return Tenant.objects.filter(memberships__user=user).order_by("slug")


def preference_tenant(*, user: AbstractBaseUser, slug: str) -> Tenant:
    tenant = preference_tenants(user=user).filter(slug=slug).first()
    if tenant is None:
        raise NotFound("No such tenant.")
    return tenant


def email_recipients(tenant: Tenant, kind: str, *, only: str | None = None) -> list[str]:
    """The addresses of the tenant's members who chose to be mailed this kind of event (``only``: of this one
    member, by username: a workspace's events are its owner's)."""
    chosen = dict(Preference.objects.filter(tenant=tenant, event=kind).values_list("user_id", "email"))
    default = EMAIL_DEFAULTS[kind]
    members = Membership.objects.filter(tenant=tenant).select_related("user").order_by("user__username")
    if only is not None:
        members = members.filter(user__username=only)
    return [
        membership.user.email
        for membership in members
        if membership.user.email and membership.user.is_active and chosen.get(membership.user_id, default)
    ]


def can_manage_webhooks(*, user: AbstractBaseUser, tenant: Tenant) -> bool:
    return user_has_role(user=user, tenant=tenant, at_least=Role.OWNER)


def webhook_list(*, user: AbstractBaseUser, slug: str) -> QuerySet[Webhook]:
    """The tenant's webhooks: a 404 for anyone outside it, a 403 for members who are not owners."""
    tenant = tenant_get(user=user, slug=slug)
    if not can_manage_webhooks(user=user, tenant=tenant):
        raise NotAllowed(f"Webhooks of {tenant.slug} are for its owners.")
    return Webhook.objects.filter(tenant=tenant).select_related("tenant").order_by("id")


def webhook_get(*, user: AbstractBaseUser, slug: str, webhook_id: int) -> Webhook:
    webhook = webhook_list(user=user, slug=slug).filter(id=webhook_id).first()
    if webhook is None:
        raise NotFound("No such webhook.")
    return webhook


def delivery_list(webhook: Webhook) -> QuerySet[Delivery]:
    """The webhook's delivery log, newest first."""
    return Delivery.objects.filter(webhook=webhook).order_by("-created_at", "-id")
