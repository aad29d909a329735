"""Writes for environments: request, provision, re-sync, delete, and the sweep that finds lost work.

Environments copy two things from the apps below: the tenant's members (tenants)
and its quota (quotas). Those apps announce changes with a signal; the receivers
in runners.environments.receivers call ``environments_resync``, the one re-sync path.
"""

import logging

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from audit.services import record
from common.dispatch import enqueue_on_commit, send_task
from common.errors import Conflict, Invalid, NotAllowed, NotFound
from common.images import allowed_image
from quotas.selectors import environment_quota_hard
from runners.backends.base import EnvironmentSpec, MemberBinding, PermanentBackendError, TransientBackendError
from runners.backends.k8s_access import AccessRefused, MemberKubeconfig
from runners.clusters.registry import get_backend
from runners.environments import signals
from runners.environments.models import Environment, EnvironmentState
from tenants.models import NAMESPACE_MAX, Membership, Role, Tenant, environment_namespace
from tenants.selectors import membership_get
from tenants.services import require_role

logger = logging.getLogger(__name__)


class EnvironmentGone(Exception):
    """The environment was deleted: its row stays for history, but there is nothing left to reach (410)."""


class ClusterUnavailable(Exception):
    """The cluster could not answer now; the message names it (503, try again)."""


class ClusterRefused(Exception):
    """The cluster answered but refused (its RBAC, a bad request); the message names it (502, an operator's to fix)."""

# How many times provisioning re-applies when members or quota change under it.
MAX_CONVERGE_ROUNDS = 3


# States in which a change of members or quota must reach the environment: ready ones are
# re-synced; ones still being built notice it themselves (their row lock orders it).
_SYNCED_STATES = [EnvironmentState.REQUESTED, EnvironmentState.PROVISIONING, EnvironmentState.READY]


def environments_resync(tenant: Tenant) -> None:
    """Have every live environment of the tenant converge on its members and quota, coalesced.

    Each change bumps the environment's sync generation in the caller's
    transaction. After commit at most one sync message is sent per environment
    (``sync_pending``); the sync that runs reads the newest state, and the one
    holding the lease goes on until no change came in while it applied. So a
    burst of quota or membership changes costs one or two backend applies per
    environment, not one per change.
    """
    ids = list(Environment.objects.filter(tenant=tenant, state__in=_SYNCED_STATES).values_list("id", flat=True))
    if not ids:
        return
    Environment.objects.filter(id__in=ids, state__in=_SYNCED_STATES).update(
        sync_generation=F("sync_generation") + 1, sync_requested_at=timezone.now()
    )
    for environment_id in ids:
        enqueue_on_commit("runners.tasks.environment_sync",
            environment_id,
            before_send=lambda environment_id=environment_id: _claim_sync_message(environment_id),
            on_failure=lambda environment_id=environment_id: _release_sync_message(environment_id),
        )


def _claim_sync_message(environment_id: int) -> bool:
    """True when no sync message is pending for a ready environment, marking one pending."""
    return bool(
        Environment.objects.filter(id=environment_id, state=EnvironmentState.READY, sync_pending=False).update(
            sync_pending=True
        )
    )


def _release_sync_message(environment_id: int) -> None:
    Environment.objects.filter(id=environment_id).update(sync_pending=False)


def environment_request(*, actor: AbstractBaseUser, tenant: Tenant, name: str, workspace_image: str = "") -> Environment:
    """Record a new environment as requested; a worker provisions it after commit."""
    require_role(user=actor, tenant=tenant, at_least=Role.MEMBER)
    if workspace_image:
        # What every member's workspaces will run: the tenant's admins choose it, here as in a change.
        require_role(user=actor, tenant=tenant, at_least=Role.ADMIN)
        allowed_image("workspace_image", workspace_image)
    namespace = environment_namespace(tenant.slug, name)
    if len(namespace) > NAMESPACE_MAX:
        raise Invalid("name", f"Too long for this tenant: the namespace {namespace!r} would exceed {NAMESPACE_MAX} characters; "
                     f"names in {tenant.slug} can have at most {NAMESPACE_MAX - len(namespace) + len(name)}.")
    if namespace.startswith("kube-") or namespace in (
        "default", settings.KUBERNETES_GPU_OPERATOR_NAMESPACE, settings.KUBERNETES_MEMBER_ACCOUNTS_NAMESPACE
    ):
        raise Invalid("name", f"The namespace {namespace!r} is reserved for the cluster; pick another name.")
    duplicate = Invalid("name", f"Tenant {tenant.slug} already has an environment named {name!r}.")
    if Environment.objects.exclude(state=EnvironmentState.DELETED).filter(tenant=tenant, name=name).exists():
        raise duplicate
    # The namespace is this tenant's by construction, so only an environment made before namespaces
    # were built this way can hold it; the refusal names nothing of whose it is.
    unavailable = Invalid("name", f"The name {name!r} cannot be used in {tenant.slug} at the moment; pick another.")
    if Environment.objects.exclude(state=EnvironmentState.DELETED).filter(namespace=namespace).exists():
        raise unavailable
    environment = Environment(
        tenant=tenant,
        name=name,
        namespace=namespace,
        backend=settings.CLUSTER_BACKEND,
        created_by=actor,
        status_message="Waiting for a worker.",
        workspace_image=workspace_image,
    )
    environment.full_clean(validate_constraints=False)
    try:
        with transaction.atomic():
            environment.save()
            record("environment.created", actor=actor, tenant=tenant, obj=environment,
                   object_repr=f"{tenant.slug}/{name}", after={"name": name, "namespace": namespace,
                                                                "backend": environment.backend,
                                                                "workspace_image": workspace_image})
            enqueue_on_commit("runners.tasks.environment_provision", environment.id)
    except IntegrityError:
        # Two requests raced past the checks above; the constraints decided.
        if Environment.objects.exclude(state=EnvironmentState.DELETED).filter(tenant=tenant, name=name).exists():
            raise duplicate from None
        raise unavailable from None
    return environment


def environment_set_workspace_image(*, actor: AbstractBaseUser, environment: Environment, image: str) -> Environment:
    """Change the image the environment's workspaces run (Kubernetes; "" for the portal's own): the tenant's
    admins may. A workspace running now keeps its image; its next start takes the new one."""
    require_role(user=actor, tenant=environment.tenant, at_least=Role.ADMIN)
    if not isinstance(image, str):
        raise Invalid("workspace_image", "A string: an image reference, or \"\" for the portal's own.")
    if image:
        allowed_image("workspace_image", image)
    with transaction.atomic():
        current = Environment.objects.select_for_update().get(id=environment.id)
        if current.state == EnvironmentState.DELETED or current.delete_requested_at is not None:
            raise Conflict("The environment is being deleted.")
        before = current.workspace_image
        if before != image:
            Environment.objects.filter(id=current.id).update(workspace_image=image)
            record("environment.workspace_image_changed", actor=actor, tenant=current.tenant, obj=current,
                   object_repr=f"{current.tenant.slug}/{current.name}", before={"workspace_image": before},
                   after={"workspace_image": image})
    environment.refresh_from_db()
    return environment


def environment_delete(*, actor: AbstractBaseUser, environment: Environment) -> Environment:
    """Mark the environment for teardown, cancelling its jobs in the same transaction; a worker deletes it after commit.

    Jobs that wait end cancelled at once; jobs that run are told to checkpoint and stop with the
    grace period, and the teardown waits until every attempt of the environment has ended, so no
    process or pod outlives the namespace it ran in and no job is retried into a deleted one.
    """

    require_role(user=actor, tenant=environment.tenant, at_least=Role.MEMBER)
    with transaction.atomic():
        # The tenant's row, then the environment's, in the order a submit takes them (no deadlock),
        # so no job slips in after the cancels.
        Tenant.objects.select_for_update().filter(id=environment.tenant_id).order_by("id").first()
        Environment.objects.select_for_update(of=("self",)).filter(id=environment.id).order_by("id").first()
        # Its work (jobs now) is cancelled here, in this transaction, by the apps that own it.
        signals.environment_deleting.send(
            sender=Environment, environment=environment,
            reason=f"Cancelled: environment {environment.name} was deleted by {actor.get_username()}.", actor=actor,
        )
        changed = (
            Environment.objects.filter(id=environment.id)
            .exclude(state__in=[EnvironmentState.DELETING, EnvironmentState.DELETED])
            .update(
                state=EnvironmentState.DELETING,
                status_message="Deleting.",
                state_changed_at=timezone.now(),
                delete_requested_at=timezone.now(),
            )
        )
        if changed:
            record("environment.deleted", actor=actor, tenant=environment.tenant, obj=environment,
                   object_repr=f"{environment.tenant.slug}/{environment.name}", before={"state": environment.state},
                   after={"state": EnvironmentState.DELETING})
            enqueue_on_commit("runners.tasks.environment_teardown", environment.id)
    environment.refresh_from_db()
    return environment


def environment_spec(environment: Environment) -> EnvironmentSpec:
    """The plain description a backend builds the environment from."""
    members = tuple(
        MemberBinding(username=username, role=role)
        # A deactivated user keeps their membership row but no access (re-activating re-syncs).
        for username, role in Membership.objects.filter(tenant=environment.tenant, user__is_active=True)
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
                environment = (
                    Environment.objects.select_for_update(of=("self",)).select_related("tenant").get(id=environment_id)
                )
                if environment.state != EnvironmentState.PROVISIONING:
                    break
                fresh = environment_spec(environment)
                if fresh == spec:
                    # What was just applied is the newest state: no sync is owed for changes so far.
                    Environment.objects.filter(id=environment_id, state=EnvironmentState.PROVISIONING).update(
                        state=EnvironmentState.READY, status_message="Ready.", state_changed_at=timezone.now(),
                        synced_generation=F("sync_generation"),
                    )
                    return EnvironmentState.READY
            spec = fresh
        else:
            raise TransientBackendError("The environment kept changing while it was provisioned; trying again.")
    except PermanentBackendError as exc:
        if _set_state(environment_id, expect=[EnvironmentState.PROVISIONING], state=EnvironmentState.FAILED,
                      message=str(exc)):
            signals.environment_failed.send(sender=Environment, environment_id=environment_id)
        return EnvironmentState.FAILED
    # It was deleted while we were building it: undo what we just made, or the
    # teardown that already ran would leave it behind.
    _undo_if_deleted(environment_id)
    return Environment.objects.get(id=environment_id).state


def _undo_if_deleted(environment_id: int) -> None:
    """Delete what a provision or sync just built when the environment was deleted meanwhile."""
    environment = Environment.objects.select_related("tenant").get(id=environment_id)
    if environment.state not in (EnvironmentState.DELETING, EnvironmentState.DELETED):
        return
    try:
        gone = get_backend().delete_environment(environment_spec(environment))
    except TransientBackendError:
        gone = False
    if not gone:
        # Leave it to a teardown that retries; mark it deleting so the teardown claims it.
        Environment.objects.filter(id=environment_id).update(
            state=EnvironmentState.DELETING, delete_requested_at=Coalesce("delete_requested_at", Now())
        )
        enqueue_on_commit("runners.tasks.environment_teardown", environment_id)


def environment_provision_give_up(*, environment_id: int, reason: str) -> None:
    """Mark an environment failed after its retries ran out."""
    if _set_state(
        environment_id,
        expect=[EnvironmentState.REQUESTED, EnvironmentState.PROVISIONING],
        state=EnvironmentState.FAILED,
        message=f"Gave up after repeated errors: {reason}",
    ):
        signals.environment_failed.send(sender=Environment, environment_id=environment_id)


def environment_note_retry(*, environment_id: int, reason: str) -> None:
    Environment.objects.filter(id=environment_id, state=EnvironmentState.PROVISIONING).update(
        status_message=f"Retrying after a transient error: {reason}"[:500]
    )


def environment_teardown_run(*, environment_id: int) -> str:
    """Ask the backend to delete one environment; DELETED once it is gone. Idempotent, never waits.

    Returns DELETING while the backend is still removing it (a namespace Terminating): the
    task asks again after a countdown. Past KUBERNETES_NAMESPACE_DELETE_TIMEOUT_S the
    environment's message says a finalizer may be stuck; teardown keeps trying.
    """
    now = timezone.now()
    claimed = Environment.objects.filter(id=environment_id, state=EnvironmentState.DELETING).update(
        state_changed_at=now, task_runs=F("task_runs") + 1, delete_requested_at=Coalesce("delete_requested_at", Now())
    )
    if not claimed:
        return Environment.objects.filter(id=environment_id).values_list("state", flat=True).first() or "missing"
    environment = Environment.objects.select_related("tenant").get(id=environment_id)

    running = signals.work_left(environment_id)
    if running:
        # Its work was cancelled with the delete; the namespace goes once all of it has stopped.
        Environment.objects.filter(id=environment_id, state=EnvironmentState.DELETING).update(
            status_message=f"Deleting: waiting for {', '.join(running)} to stop."
        )
        return EnvironmentState.DELETING
    if get_backend().delete_environment(environment_spec(environment)):
        _set_state(
            environment_id, expect=[EnvironmentState.DELETING], state=EnvironmentState.DELETED, message="Deleted."
        )
        return EnvironmentState.DELETED
    waited = (now - environment.delete_requested_at).total_seconds()
    if waited > settings.KUBERNETES_NAMESPACE_DELETE_TIMEOUT_S:
        message = (
            f"Namespace {environment.namespace} is still terminating {waited:.0f}s after it was deleted; "
            f"a finalizer may be stuck (`kubectl get namespace {environment.namespace} -o yaml` shows which)."
        )
    else:
        message = f"Deleting: waiting for namespace {environment.namespace} to go."
    Environment.objects.filter(id=environment_id, state=EnvironmentState.DELETING).update(status_message=message)
    return EnvironmentState.DELETING


def environment_sync_run(*, environment_id: int) -> bool:
    """Converge a ready environment on its newest members and quota.

    Syncs of one environment are serialised by a lease on its row, taken and
    released by conditional updates, so no lock is held across the backend call
    and an older spec can never be applied after a newer one. The lease holder
    applies again until the sync generation stayed put while it applied; a
    sync that finds the lease taken leaves the work to the holder. While the
    environment is still provisioning, the provision run applies the latest
    spec itself. Returns whether this run applied anything.
    """
    now = timezone.now()
    claimed = (
        Environment.objects.filter(id=environment_id, state=EnvironmentState.READY)
        .filter(Q(sync_lease_until__isnull=True) | Q(sync_lease_until__lt=now))
        .update(sync_pending=False, sync_lease_until=now + timezone.timedelta(seconds=settings.STUCK_AFTER_S))
    )
    if not claimed:
        return False
    try:
        while True:
            environment = Environment.objects.select_related("tenant").get(id=environment_id)
            if environment.state != EnvironmentState.READY:
                Environment.objects.filter(id=environment_id).update(sync_lease_until=None)
                _undo_if_deleted(environment_id)  # deleted while an earlier round applied
                return False
            generation = environment.sync_generation
            get_backend().ensure_environment(environment_spec(environment))
            if Environment.objects.filter(id=environment_id, sync_generation=generation).update(
                synced_generation=generation, sync_lease_until=None
            ):
                _undo_if_deleted(environment_id)
                return True
            # Changed while we applied: renew the lease and apply the newest state.
            Environment.objects.filter(id=environment_id).update(
                sync_lease_until=timezone.now() + timezone.timedelta(seconds=settings.STUCK_AFTER_S)
            )
    except BaseException:
        # Let the retry (or the sweep) take it at once; a retry counts as the pending message.
        Environment.objects.filter(id=environment_id).update(sync_lease_until=None, sync_pending=True)
        raise


def environment_sweep_run(*, stuck_after_s: int) -> dict[str, list[int]]:
    """Find environments whose task message was lost (or never sent) and enqueue them again."""
    cutoff = timezone.now() - timezone.timedelta(seconds=stuck_after_s)
    found: dict[str, list[int]] = {"provision": [], "teardown": [], "sync": []}
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
            send_task("runners.tasks.environment_teardown", environment_id)
        else:
            found["provision"].append(environment_id)
            send_task("runners.tasks.environment_provision", environment_id)
    # Ready environments behind on a change whose sync was lost: nobody holds the lease, and the
    # change is older than the cutoff. Touch the request time so the next sweep waits again.
    behind = Environment.objects.filter(
        state=EnvironmentState.READY, sync_generation__gt=F("synced_generation"), sync_requested_at__lt=cutoff
    ).filter(Q(sync_lease_until__isnull=True) | Q(sync_lease_until__lt=timezone.now()))
    for environment_id in behind.values_list("id", flat=True):
        if Environment.objects.filter(id=environment_id, sync_requested_at__lt=cutoff).update(
            sync_requested_at=timezone.now(), sync_pending=True
        ):
            found["sync"].append(environment_id)
            send_task("runners.tasks.environment_sync", environment_id, on_failure=lambda i=environment_id: _release_sync_message(i))
    if any(found.values()):
        logger.warning("Sweep re-enqueued stuck environments: %s", found)
    return found


# --- A member's own access (kubeconfig) ------------------------------------------------------


def environment_require_live(environment: Environment) -> None:
    """Raise EnvironmentGone for a deleted environment."""
    if environment.state == EnvironmentState.DELETED:
        when = environment.state_changed_at.strftime("%Y-%m-%d %H:%M UTC")
        raise EnvironmentGone(f"Environment {environment.id} ({environment.name}) was deleted on {when}.")


def _access_spec(environment: Environment) -> EnvironmentSpec:
    """What a member's access needs of the environment: its identity and namespace (no members, no quota)."""
    return EnvironmentSpec(environment_id=environment.id, tenant_slug=environment.tenant.slug,
                           name=environment.name, namespace=environment.namespace)


def environment_kubeconfig(*, actor: AbstractBaseUser, environment: Environment) -> MemberKubeconfig:
    """A kubeconfig for the actor, for this environment's namespace only, with a short-lived token.

    Any member may have one; the rights inside follow their role (viewers read). It has to call
    the cluster while the person waits (the token is minted now), so it must run outside any
    transaction: nothing is written to the database and no row is locked, and each call is
    bounded by KUBECONFIG_REQUEST_TIMEOUT_S.
    """
    environment_require_live(environment)
    membership = membership_get(user=actor, tenant=environment.tenant)
    if membership is None:
        # Staff see every environment but belong to none: access of theirs would be pruned by the next re-sync.
        raise NotAllowed(f"A kubeconfig is for members of {environment.tenant.slug}; you are not one.")
    role = membership.role
    if environment.backend != "kubernetes":
        raise Conflict(
            f"Environment {environment.id} runs on the {environment.backend} backend; it has no kubeconfig. "
            "Submit work to it through the portal's API (POST /api/v1/jobs/)."
        )
    if environment.state != EnvironmentState.READY:
        raise Conflict(f"Environment {environment.id} is {environment.state}; a kubeconfig is available once it is ready.")
    member = MemberBinding(username=actor.get_username(), role=role)
    backend, spec = get_backend(), _access_spec(environment)
    try:
        config = backend.member_kubeconfig(
            spec, member, expiration_s=settings.KUBECONFIG_TOKEN_TTL_S, timeout_s=settings.KUBECONFIG_REQUEST_TIMEOUT_S,
        )
    except AccessRefused as exc:
        raise Conflict(str(exc)) from None
    except TransientBackendError as exc:
        raise ClusterUnavailable(str(exc)) from None
    except PermanentBackendError as exc:
        logger.error("Kubeconfig for %s in environment %s refused by the cluster: %s", member.username,
                     environment.id, exc)
        raise ClusterRefused(f"The cluster refused to give {member.username} access: {exc}") from None
    # Removed (or deactivated) while the token was minted: the revoke that removal queued may have run
    # before this ServiceAccount existed, so take it back here rather than hand it out.
    if not _is_active_member(actor, environment.tenant_id):
        try:
            backend.revoke_member_access(spec, member.username)
        except (TransientBackendError, PermanentBackendError) as exc:
            logger.warning("Could not revoke %s's fresh access to environment %s (the next re-sync will): %s",
                           member.username, environment.id, exc)
        raise NotFound("No such environment.")
    return config


def _is_active_member(user: AbstractBaseUser, tenant_id: int) -> bool:
    return Membership.objects.filter(tenant_id=tenant_id, user_id=user.pk, user__is_active=True).exists()


def environments_access_revoke(*, tenant: Tenant, username: str) -> None:
    """After commit, have a worker revoke what the user was given in the tenant's Kubernetes environments."""
    live = Environment.objects.filter(tenant=tenant, backend="kubernetes").exclude(state=EnvironmentState.DELETED)
    if live.exists():
        enqueue_on_commit("runners.tasks.environment_access_revoke", tenant.id, username)


def environment_access_revoke_run(*, tenant_id: int, username: str) -> list[int]:
    """Delete the user's ServiceAccount and RoleBindings in every live Kubernetes environment of the tenant.

    Their tokens stop working with the ServiceAccount. Returns the environments revoked in. Someone
    added back since keeps theirs: the re-sync their return started binds them to their new role.
    Transient errors propagate (the task retries); the next re-sync's prune removes them too.
    """
    if Membership.objects.filter(tenant_id=tenant_id, user__username=username, user__is_active=True).exists():
        return []
    environments = (
        Environment.objects.filter(tenant_id=tenant_id, backend="kubernetes")
        .exclude(state=EnvironmentState.DELETED).select_related("tenant").order_by("id")
    )
    backend = get_backend()
    revoked = []
    for environment in environments:
        backend.revoke_member_access(_access_spec(environment), username)
        revoked.append(environment.id)
    if revoked:
        logger.info("Revoked %s's access to environments %s.", username, revoked)
    return revoked
