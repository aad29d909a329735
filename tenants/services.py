"""Writes for tenants and their members. Business rules live here.

A change of members is announced (tenants.signals.members_changed; a removal also sends
member_removed, so credentials handed to that person are revoked); the apps above that
keep copies of the member list (runners' environments) subscribe to them.
"""

import logging
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from knox.models import AuthToken
from knox.settings import knox_settings

from common.errors import Invalid, NotAllowed, NotFound
from tenants.models import Membership, Role, Tenant, TokenInfo, role_at_least
from tenants.selectors import token_get, user_has_role, user_role
from tenants.signals import audited, member_removed, members_changed

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
            audited("tenant.created", actor=actor, tenant=tenant, obj=tenant, after={"slug": slug, "name": name})
    except IntegrityError:
        raise Invalid("slug", f"A tenant with slug {slug!r} already exists.") from None
    return tenant


@transaction.atomic
def tenant_moves_set(*, actor: AbstractBaseUser, tenant: Tenant, allow: bool) -> Tenant:
    """Let the scheduler move the tenant's preemptible jobs to make room (runners.scheduling.defrag), or not; an
    admin's choice. Turned off, no job of the tenant is moved from the next scheduler cycle on; a move already
    under way finishes."""
    require_role(user=actor, tenant=tenant, at_least=Role.ADMIN)
    tenant = Tenant.objects.select_for_update().get(id=tenant.id)
    if tenant.allow_moves != allow:
        before = tenant.allow_moves
        tenant.allow_moves = allow
        tenant.save(update_fields=["allow_moves"])
        audited("tenant.moves_set", actor=actor, tenant=tenant, obj=tenant, before={"allow_moves": before},
                after={"allow_moves": allow})
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
    audited("member.added", actor=actor, tenant=tenant, obj=membership, object_repr=f"{username} in {tenant.slug}",
            after={"username": username, "role": role})
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
    audited("member.removed", actor=actor, tenant=tenant, obj=membership, object_repr=f"{username} in {tenant.slug}",
            before={"username": username, "role": membership.role})
    membership.delete()
    members_changed.send(sender=Tenant, tenant=tenant)
    member_removed.send(sender=Tenant, tenant=tenant, username=username)




# --- API tokens ----------------------------------------------------------------------------------

TOKEN_NAME_MAX = 100
TOKEN_MAX_DAYS = 365


def token_create(*, user: AbstractBaseUser, name: str, expires_in_days: int | None = None):
    """A new API token for `user`: (its TokenInfo, the secret). The secret is shown once: only its
    hash is kept. Without `expires_in_days` it lives API_TOKEN_TTL_HOURS."""
    name = name.strip() if isinstance(name, str) else ""
    if not name:
        raise Invalid("name", "Give the token a name, so you can tell it from your others.")
    if len(name) > TOKEN_NAME_MAX:
        raise Invalid("name", f"At most {TOKEN_NAME_MAX} characters.")
    if expires_in_days is not None and (
        isinstance(expires_in_days, bool) or not isinstance(expires_in_days, int)
        or not 1 <= expires_in_days <= TOKEN_MAX_DAYS
    ):
        raise Invalid("expires_in_days", f"A whole number of days from 1 to {TOKEN_MAX_DAYS}.")
    ttl = knox_settings.TOKEN_TTL if expires_in_days is None else timedelta(days=expires_in_days)
    with transaction.atomic():
        instance, secret = AuthToken.objects.create(user, expiry=ttl)
        info = TokenInfo.objects.create(token=instance, name=name)
        audited("token.created", actor=user, obj=info, object_repr=f"{name} of {user.get_username()}",
                after=token_audit_fields(info))
    return info, secret


def token_audit_fields(info: TokenInfo) -> dict:
    """What the audit log keeps of a token: never its secret or hash, only what tells it apart."""
    return {"name": info.name, "user": info.token.user.get_username(), "expiry": info.token.expiry}


def token_revoke(*, actor: AbstractBaseUser, token_id: int) -> TokenInfo:
    """Revoke one of the actor's tokens (staff: anyone's) and return what it was; another user's is a
    404, as if it did not exist."""
    with transaction.atomic():
        info = token_get(user=actor, token_id=token_id)
        before = token_audit_fields(info)
        # The TokenInfo goes with it. Of two revokes at once, the second deletes nothing: a 404, no entry.
        if not AuthToken.objects.filter(pk=info.token.pk).delete()[0]:
            raise NotFound("This token no longer exists.")
        audited("token.revoked", actor=actor, obj=info, object_repr=f"{info.name} of {info.token.user.get_username()}",
                before=before)
    return info


def token_revoke_own(*, token: AuthToken) -> None:
    """Revoke the token a request came with (signing out of the API)."""
    with transaction.atomic():
        info = TokenInfo.objects.select_related("token__user").filter(token=token).first()
        before = token_audit_fields(info) if info is not None else None
        # Two sign-outs with one token at once: the second deletes nothing and records nothing.
        if not AuthToken.objects.filter(pk=token.pk).delete()[0]:
            return
        if info is None:  # a token made outside the portal's services (the Django admin): no name to show
            # Its key is the hash of its secret: kept out of the log.
            audited("token.revoked", actor=token.user, obj=token, object_id="",
                    object_repr=f"token of {token.user.get_username()}",
                    before={"user": token.user.get_username(), "expiry": token.expiry})
        else:
            audited("token.revoked", actor=token.user, obj=info, object_repr=f"{info.name} of {token.user.get_username()}",
                    before=before)
