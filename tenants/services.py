"""Writes for tenants and their members. Business rules live here.

A change of members is announced (tenants.signals.members_changed); the apps above that
keep copies of the member list (runners' environments) subscribe to it.
"""

import logging

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction

from common.errors import Invalid, NotAllowed, NotFound
from tenants.models import Membership, Role, Tenant, role_at_least
from tenants.selectors import user_has_role, user_role
from tenants.signals import members_changed

logger = logging.getLogger(__name__)


def require_role(*, user: AbstractBaseUser, tenant: Tenant, at_least: str) -> str:
    """Raise NotAllowed unless the user holds at least this role in the tenant."""
    if not user_has_role(user=user, tenant=tenant, at_least=at_least):
        raise NotAllowed(f"This needs the {at_least} role or higher in tenant {tenant.slug}.")
    return user_role(user=user, tenant=tenant)


def tenant_create(*, actor: AbstractBaseUser, slug: str, name: str) -> Tenant:
    if not actor.is_staff:
        raise NotAllowed("Only staff can create tenants.")
    if Tenant.objects.filter(slug=slug).exists():
        raise Invalid("slug", f"A tenant with slug {slug!r} already exists.")
    tenant = Tenant(slug=slug, name=name)
    tenant.full_clean()
    try:
        with transaction.atomic():
            tenant.save()
    except IntegrityError:
        raise Invalid("slug", f"A tenant with slug {slug!r} already exists.") from None
    return tenant


@transaction.atomic
def membership_add(*, actor: AbstractBaseUser, tenant: Tenant, username: str, role: str) -> Membership:
    """Add a user to a tenant; admins may grant up to admin, owners and staff anything."""
    actor_role = require_role(user=actor, tenant=tenant, at_least=Role.ADMIN)
    if role not in Role.values:
        raise Invalid("role", f"{role!r} is not a role; use one of {', '.join(Role.values)}.")
    if not role_at_least(actor_role, role):
        raise NotAllowed(f"Granting {role} needs the {role} role yourself.")
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise Invalid("username", f"There is no user named {username!r}.")
    duplicate = Invalid("username", f"{username} is already a member of {tenant.slug}.")
    if Membership.objects.filter(tenant=tenant, user=user).exists():
        raise duplicate
    try:
        with transaction.atomic():
            membership = Membership.objects.create(tenant=tenant, user=user, role=role)
    except IntegrityError:
        raise duplicate from None  # a concurrent add won
    members_changed.send(sender=Tenant, tenant=tenant)
    return membership


@transaction.atomic
def membership_remove(*, actor: AbstractBaseUser, tenant: Tenant, username: str) -> None:
    actor_role = require_role(user=actor, tenant=tenant, at_least=Role.ADMIN)
    # Lock the tenant: two owners removing each other at once must not leave it ownerless. A
    # no-key lock, so creating an environment (whose foreign key takes a key-share lock) never waits.
    Tenant.objects.select_for_update(no_key=True).get(pk=tenant.pk)
    membership = Membership.objects.filter(tenant=tenant, user__username=username).first()
    if membership is None:
        raise NotFound(f"{username} is not a member of {tenant.slug}.")
    if not role_at_least(actor_role, membership.role):
        raise NotAllowed(f"Removing an {membership.role} needs the {membership.role} role yourself.")
    if membership.role == Role.OWNER and not Membership.objects.filter(tenant=tenant, role=Role.OWNER).exclude(
        id=membership.id
    ).exists():
        raise Invalid("username", f"{username} is the last owner of {tenant.slug}; add another owner first.")
    membership.delete()
    members_changed.send(sender=Tenant, tenant=tenant)


