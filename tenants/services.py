"""Writes for tenants, members and environments. Business rules live here."""

import logging

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from runners.backends.base import EnvironmentSpec, MemberBinding, PermanentBackendError, TransientBackendError
from runners.backends.registry import get_backend
from tenants.models import (
    ROLE_RANK,
    Environment,
    EnvironmentState,
    Membership,
    Role,
    Tenant,
)
from tenants.selectors import user_has_role, user_role

logger = logging.getLogger(__name__)
NAMESPACE_MAX = 63
# How many times provisioning re-applies when members or quota change under it.
MAX_CONVERGE_ROUNDS = 3


def require_role(*, user: AbstractBaseUser, tenant: Tenant, at_least: str) -> str:
    """Raise PermissionDenied unless the user holds at least this role in the tenant."""
    if not user_has_role(user=user, tenant=tenant, at_least=at_least):
        raise PermissionDenied(f"This needs the {at_least} role or higher in tenant {tenant.slug}.")
    return user_role(user=user, tenant=tenant)


def tenant_create(*, actor: AbstractBaseUser, slug: str, name: str) -> Tenant:
    if not actor.is_staff:
        raise PermissionDenied("Only staff can create tenants.")
    if Tenant.objects.filter(slug=slug).exists():
        raise ValidationError({"slug": f"A tenant with slug {slug!r} already exists."})
    tenant = Tenant(slug=slug, name=name)
    tenant.full_clean()
    try:
        with transaction.atomic():
            tenant.save()
    except IntegrityError:
        raise ValidationError({"slug": f"A tenant with slug {slug!r} already exists."}) from None
    return tenant


@transaction.atomic
def membership_add(*, actor: AbstractBaseUser, tenant: Tenant, username: str, role: str) -> Membership:
    """Add a user to a tenant; admins may grant up to admin, owners and staff anything."""
    actor_role = require_role(user=actor, tenant=tenant, at_least=Role.ADMIN)
    if role not in Role.values:
        raise ValidationError({"role": f"{role!r} is not a role; use one of {', '.join(Role.values)}."})
    if ROLE_RANK[role] > ROLE_RANK[actor_role]:
        raise PermissionDenied(f"Granting {role} needs the {role} role yourself.")
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise ValidationError({"username": f"There is no user named {username!r}."})
    duplicate = ValidationError({"username": f"{username} is already a member of {tenant.slug}."})
    if Membership.objects.filter(tenant=tenant, user=user).exists():
        raise duplicate
    try:
        with transaction.atomic():
            membership = Membership.objects.create(tenant=tenant, user=user, role=role)
    except IntegrityError:
        raise duplicate from None  # a concurrent add won
    _resync_environments(tenant)
    return membership


@transaction.atomic
def membership_remove(*, actor: AbstractBaseUser, tenant: Tenant, username: str) -> None:
    actor_role = require_role(user=actor, tenant=tenant, at_least=Role.ADMIN)
    # Lock the tenant: two owners removing each other at once must not leave it ownerless.
    Tenant.objects.select_for_update().get(pk=tenant.pk)
    membership = Membership.objects.filter(tenant=tenant, user__username=username).first()
    if membership is None:
        from django.http import Http404

        raise Http404(f"{username} is not a member of {tenant.slug}.")
    if ROLE_RANK[membership.role] > ROLE_RANK[actor_role]:
        raise PermissionDenied(f"Removing an {membership.role} needs the {membership.role} role yourself.")
    if membership.role == Role.OWNER and not Membership.objects.filter(tenant=tenant, role=Role.OWNER).exclude(
        id=membership.id
    ).exists():
        raise ValidationError({"username": f"{username} is the last owner of {tenant.slug}; add another owner first."})
    membership.delete()
    _resync_environments(tenant)


def _resync_environments(tenant: Tenant) -> None:
    """Ask the workers to converge every ready environment of the tenant (members, quota)."""
    from tenants.tasks import environment_sync

    ids = list(Environment.objects.filter(tenant=tenant, state=EnvironmentState.READY).values_list("id", flat=True))
    for environment_id in ids:
        transaction.on_commit(lambda environment_id=environment_id: environment_sync.delay(environment_id))


def environment_request(*, actor: AbstractBaseUser, tenant: Tenant, name: str) -> Environment:
    """Record a new environment as requested; a worker provisions it after commit."""
    from tenants.tasks import environment_provision

    require_role(user=actor, tenant=tenant, at_least=Role.MEMBER)
    namespace = f"{tenant.slug}-{name}"
    if len(namespace) > NAMESPACE_MAX:
        raise ValidationError(
            {"name": f"Too long for this tenant: the namespace {namespace!r} would exceed {NAMESPACE_MAX} characters."}
        )
    if namespace.startswith("kube-") or namespace in ("default", settings.KUBERNETES_GPU_OPERATOR_NAMESPACE):
        raise ValidationError({"name": f"The namespace {namespace!r} is reserved for the cluster; pick another name."})
    if Environment.objects.exclude(state=EnvironmentState.DELETED).filter(tenant=tenant, name=name).exists():
        raise ValidationError({"name": f"Tenant {tenant.slug} already has an environment named {name!r}."})
    if Environment.objects.exclude(state=EnvironmentState.DELETED).filter(namespace=namespace).exists():
        raise ValidationError({"name": f"The namespace {namespace!r} is already taken; pick another name."})
    environment = Environment(
        tenant=tenant,
        name=name,
        namespace=namespace,
        backend=settings.CLUSTER_BACKEND,
        created_by=actor,
        status_message="Waiting for a worker.",
    )
    environment.full_clean(validate_constraints=False)
    try:
        with transaction.atomic():
            environment.save()
            transaction.on_commit(lambda: environment_provision.delay(environment.id))
    except IntegrityError:
        # Two requests raced past the check above; the constraint decided.
        raise ValidationError({"name": f"Tenant {tenant.slug} already has an environment named {name!r}."}) from None
    return environment


def environment_delete(*, actor: AbstractBaseUser, environment: Environment) -> Environment:
    """Mark the environment for teardown; a worker deletes it after commit."""
    from tenants.tasks import environment_teardown

    require_role(user=actor, tenant=environment.tenant, at_least=Role.MEMBER)
    with transaction.atomic():
        changed = (
            Environment.objects.filter(id=environment.id)
            .exclude(state__in=[EnvironmentState.DELETING, EnvironmentState.DELETED])
            .update(state=EnvironmentState.DELETING, status_message="Deleting.", state_changed_at=timezone.now())
        )
        if changed:
            transaction.on_commit(lambda: environment_teardown.delay(environment.id))
    environment.refresh_from_db()
    return environment


def environment_spec(environment: Environment) -> EnvironmentSpec:
    """The plain description a backend builds the environment from."""
    from quotas.selectors import environment_quota_hard

    members = tuple(
        MemberBinding(username=username, role=role)
        for username, role in Membership.objects.filter(tenant=environment.tenant)
        .order_by("user__username")
        .values_list("user__username", "role")
    )
    return EnvironmentSpec(
        environment_id=environment.id,
        tenant_slug=environment.tenant.slug,
        name=environment.name,
        namespace=environment.namespace,
        members=members,
        quota_hard=environment_quota_hard(tenant=environment.tenant),
    )


def _set_state(environment_id: int, *, expect: list[str], state: str, message: str) -> bool:
    """Conditionally move an environment to a new state; False if it was elsewhere."""
    return bool(
        Environment.objects.filter(id=environment_id, state__in=expect).update(
            state=state, status_message=message[:500], state_changed_at=timezone.now()
        )
    )


def environment_provision_run(*, environment_id: int) -> str:
    """Bring one environment to ready. Safe to run twice, or after a worker died mid-way.

    Returns the state the environment is left in. Transient backend errors
    propagate so the task can retry; permanent ones mark it failed.
    """
    claimed = Environment.objects.filter(
        id=environment_id, state__in=[EnvironmentState.REQUESTED, EnvironmentState.PROVISIONING]
    ).update(
        state=EnvironmentState.PROVISIONING,
        status_message="Provisioning.",
        state_changed_at=timezone.now(),
        task_runs=F("task_runs") + 1,
    )
    if not claimed:
        # Ready, failed, or being deleted: someone else has it, or it is done.
        return Environment.objects.filter(id=environment_id).values_list("state", flat=True).first() or "missing"
    environment = Environment.objects.select_related("tenant").get(id=environment_id)
    try:
        backend = get_backend()
        spec = environment_spec(environment)
        for _round in range(MAX_CONVERGE_ROUNDS):
            backend.ensure_environment(spec)
            with transaction.atomic():
                # Members or quota may have changed while we built it; their resync
                # skips environments still provisioning, so catch up here, under the
                # row lock that resyncs take too.
                environment = Environment.objects.select_for_update().select_related("tenant").get(id=environment_id)
                if environment.state != EnvironmentState.PROVISIONING:
                    break
                fresh = environment_spec(environment)
                if fresh == spec:
                    _set_state(environment_id, expect=[EnvironmentState.PROVISIONING], state=EnvironmentState.READY,
                               message="Ready.")
                    return EnvironmentState.READY
            spec = fresh
        else:
            raise TransientBackendError("The environment kept changing while it was provisioned; trying again.")
    except PermanentBackendError as exc:
        _set_state(environment_id, expect=[EnvironmentState.PROVISIONING], state=EnvironmentState.FAILED, message=str(exc))
        return EnvironmentState.FAILED
    # It was deleted while we were building it: undo what we just made, or the
    # teardown that already ran would leave it behind.
    _undo_if_deleted(environment_id)
    return Environment.objects.get(id=environment_id).state


def _undo_if_deleted(environment_id: int) -> None:
    """Delete what a provision or sync just built when the environment was deleted meanwhile."""
    from tenants.tasks import environment_teardown

    environment = Environment.objects.select_related("tenant").get(id=environment_id)
    if environment.state not in (EnvironmentState.DELETING, EnvironmentState.DELETED):
        return
    try:
        get_backend().delete_environment(environment_spec(environment))
    except TransientBackendError:
        # Leave it to a teardown that retries; mark it deleting so the teardown claims it.
        Environment.objects.filter(id=environment_id).update(state=EnvironmentState.DELETING)
        transaction.on_commit(lambda: environment_teardown.delay(environment_id))


def environment_provision_give_up(*, environment_id: int, reason: str) -> None:
    """Mark an environment failed after its retries ran out."""
    _set_state(
        environment_id,
        expect=[EnvironmentState.REQUESTED, EnvironmentState.PROVISIONING],
        state=EnvironmentState.FAILED,
        message=f"Gave up after repeated errors: {reason}",
    )


def environment_note_retry(*, environment_id: int, reason: str) -> None:
    Environment.objects.filter(id=environment_id, state=EnvironmentState.PROVISIONING).update(
        status_message=f"Retrying after a transient error: {reason}"[:500]
    )


def environment_teardown_run(*, environment_id: int) -> str:
    """Delete one environment from its backend and mark it deleted. Idempotent."""
    claimed = Environment.objects.filter(id=environment_id, state=EnvironmentState.DELETING).update(
        state_changed_at=timezone.now(), task_runs=F("task_runs") + 1
    )
    if not claimed:
        return Environment.objects.filter(id=environment_id).values_list("state", flat=True).first() or "missing"
    environment = Environment.objects.select_related("tenant").get(id=environment_id)
    get_backend().delete_environment(environment_spec(environment))
    _set_state(environment_id, expect=[EnvironmentState.DELETING], state=EnvironmentState.DELETED, message="Deleted.")
    return EnvironmentState.DELETED


def environment_sync_run(*, environment_id: int) -> bool:
    """Converge a ready environment after its members or quota changed.

    The row lock serialises syncs of one environment, so an older spec can never
    be applied after a newer one. While the environment is still provisioning,
    the provision run applies the latest spec itself.
    """
    with transaction.atomic():
        environment = Environment.objects.select_for_update().select_related("tenant").filter(id=environment_id).first()
        if environment is None or environment.state != EnvironmentState.READY:
            return False
        get_backend().ensure_environment(environment_spec(environment))
    return True


def environment_sweep_run(*, stuck_after_s: int) -> dict[str, list[int]]:
    """Find environments whose task message was lost and enqueue them again."""
    from tenants.tasks import environment_provision, environment_teardown

    cutoff = timezone.now() - timezone.timedelta(seconds=stuck_after_s)
    found: dict[str, list[int]] = {"provision": [], "teardown": []}
    stale = Environment.objects.filter(state_changed_at__lt=cutoff)
    for environment_id, state in stale.filter(
        state__in=[EnvironmentState.REQUESTED, EnvironmentState.PROVISIONING, EnvironmentState.DELETING]
    ).values_list("id", "state"):
        # Touch the row so the next sweep waits a full interval before trying again.
        if not Environment.objects.filter(id=environment_id, state=state, state_changed_at__lt=cutoff).update(
            state_changed_at=timezone.now()
        ):
            continue
        if state == EnvironmentState.DELETING:
            found["teardown"].append(environment_id)
            environment_teardown.delay(environment_id)
        else:
            found["provision"].append(environment_id)
            environment_provision.delay(environment_id)
    if found["provision"] or found["teardown"]:
        logger.warning("Sweep re-enqueued stuck environments: %s", found)
    return found
