"""Workspaces: create, start, stop, delete, and the pass that watches each one (readiness and the idle cull).

A start queues a job of kind "workspace" through the jobs app, as an endpoint's replica is queued: the
scheduler cycle admits and places it within the tenant's quota. It is on the guarantee (not preemptible)
when the tenant's guarantee on the flavor has room for it at the start, and borrows (preemptible) when it
has not. A preempted workspace is told to stop with the grace period, then waits in the queue again; its
home folder is not touched.
"""

from __future__ import annotations

import logging
import re
from datetime import timedelta

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import F, Sum
from django.utils import timezone

from audit.services import SYSTEM, record
from common.dispatch import send_task, send_task_at_most_every
from common.errors import Conflict, Invalid, NotFound
from quotas.models import Quota, ResourceFlavor
from runners.environments.models import Environment, EnvironmentState
from runners.jobs import services as jobs
from runners.jobs.models import JOB_FINAL_STATES, JOB_HOLDING_STATES, Job, JobState
from runners.workspaces import signals
from runners.workspaces.models import Workspace, WorkspaceState, new_key
from tenants.models import Role, Tenant
from tenants.services import require_role

log = logging.getLogger(__name__)

NAME_PATTERN = r"[a-z0-9]([-a-z0-9]{0,28}[a-z0-9])?"
FIELDS = ("tenant", "environment", "name", "flavor", "gpus", "cpu_milli", "memory_mib", "shared", "idle_minutes")
BOUNDS = {"gpus": (0, 8), "cpu_milli": (250, 64_000), "memory_mib": (1024, 512 * 1024), "idle_minutes": (1, 7 * 24 * 60)}
# A workspace's job is stopped and started, never retried: a crash shows as failed, and a start tries again.
MAX_RETRIES = 0


def _whole(data: dict, field: str, default: int | None) -> int | None:
    value = data.get(field, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(field, "A whole number.")
    low, high = BOUNDS[field]
    if not low <= value <= high:
        raise Invalid(field, f"Between {low} and {high}.")
    return value


def workspace_create(*, actor: AbstractBaseUser, data) -> Workspace:
    """Check a new workspace's fields, write it, and start it (``"start": false`` leaves it stopped)."""
    if not isinstance(data, dict):
        raise Invalid("body", "A JSON object.")
    unknown = sorted(set(data) - set(FIELDS) - {"start"})
    if unknown:
        raise Invalid(unknown[0], "Not a field of a workspace.")
    for field in ("tenant", "environment", "name", "flavor"):
        if data.get(field) in (None, ""):
            raise Invalid(field, "This field is required.")
    tenant = Tenant.objects.filter(slug=str(data["tenant"])).first()
    if tenant is None:
        raise Invalid("tenant", f"No tenant {data['tenant']!r}.")
    require_role(user=actor, tenant=tenant, at_least=Role.MEMBER)
    name = data["name"]
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        raise Invalid("name", "Lower-case letters, digits and '-', at most 30, starting and ending with a letter or digit.")
    environment = data["environment"]
    if isinstance(environment, bool) or not isinstance(environment, int) or not 1 <= environment < 2 ** 63:
        raise Invalid("environment", "The environment's id, a whole number.")
    environment = Environment.objects.filter(id=environment, tenant=tenant).first()
    if environment is None:
        raise Invalid("environment", f"No environment {data['environment']} in tenant {tenant.slug}.")
    if environment.state != EnvironmentState.READY:
        raise Invalid("environment", f"Environment {environment.name} is {environment.state}, not ready.")
    flavor = ResourceFlavor.objects.filter(name=str(data["flavor"])).first()
    if flavor is None:
        raise Invalid("flavor", f"No flavor {data['flavor']!r}.")
    gpus = _whole(data, "gpus", 1)
    cpu_milli = _whole(data, "cpu_milli", settings.WORKSPACE_CPU_MILLI)
    memory_mib = _whole(data, "memory_mib", settings.WORKSPACE_MEMORY_MIB)
    idle_minutes = _whole(data, "idle_minutes", None)
    shared = data.get("shared", False)
    if not isinstance(shared, bool):
        raise Invalid("shared", "Must be true or false.")
    start = data.get("start", True)
    if not isinstance(start, bool):
        raise Invalid("start", "Must be true or false.")
    try:
        with transaction.atomic():
            workspace = Workspace.objects.create(
                tenant=tenant, environment=environment, owner=actor, name=name, flavor=flavor, gpus=gpus,
                cpu_milli=cpu_milli, memory_mib=memory_mib, shared=shared, idle_minutes=idle_minutes)
            record("workspace.created", actor=actor, tenant=tenant, obj=workspace, object_repr=name,
                   after={"environment": environment.name, "flavor": flavor.name, "gpus": gpus, "shared": shared})
            if start:
                workspace = _start_locked(workspace, actor=actor, why=f"Started by {actor.get_username()}.")
    except IntegrityError:
        raise Invalid("name", f"Tenant {tenant.slug} already has a workspace named {name}.") from None
    return workspace


def _locked(workspace: Workspace) -> Workspace:
    found = Workspace.objects.select_for_update(of=("self",)).filter(id=workspace.id).select_related(
        "tenant", "environment", "flavor", "owner").first()
    if found is None:
        raise NotFound("No such workspace.")
    return found


def _fits_guarantee(tenant: Tenant, flavor: ResourceFlavor, units: int) -> bool:
    """Whether the tenant's guarantee on the flavor has room for ``units`` beside its work that is not preemptible
    (the caller holds the tenant's row: two starts at once do not both take the last of it)."""
    guaranteed = Quota.objects.filter(tenant=tenant, flavor=flavor).values_list("guaranteed", flat=True).first() or 0
    held = Job.objects.filter(tenant=tenant, flavor=flavor, preemptible=False,
                              state__in=JOB_HOLDING_STATES + [JobState.QUEUED]).aggregate(
        units=Sum(F("replicas") * F("gpus_per_replica")))["units"] or 0
    return held + units <= guaranteed


def job_spec(workspace: Workspace, *, preemptible: bool) -> dict:
    """The spec of one start's job, built here from the workspace's checked fields only."""
    return {
        "tenant": workspace.tenant.slug, "environment": workspace.environment_id,
        "name": f"ws-{workspace.name}", "template": "workspace", "replicas": 1, "flavor": workspace.flavor.name,
        "gpus_per_replica": workspace.gpus, "cpu_milli_per_replica": workspace.cpu_milli,
        "memory_mib_per_replica": workspace.memory_mib, "topology": {"level": "none", "mode": "preferred"},
        "priority": 0, "preemptible": preemptible, "steps": 1, "checkpoint_every_steps": 0,
        "max_runtime_s": jobs.MAX_RUNTIME_S, "max_retries": MAX_RETRIES, "env": {}, "hyperparameters": {},
        "image": None, "command": None, "workspace": {"workspace_id": workspace.id},
    }


def _start_locked(workspace: Workspace, *, actor, why: str) -> Workspace:
    if workspace.job_id is not None and workspace.job.state not in JOB_FINAL_STATES:
        raise Conflict(f"Workspace {workspace.name} is {workspace.state}; stop it before starting it again.")
    environment = jobs.queue_locks(workspace.tenant, workspace.environment)
    if environment is None or environment.state != EnvironmentState.READY:
        raise Invalid("environment", f"Environment {workspace.environment.name} is not ready.")
    preemptible = not _fits_guarantee(workspace.tenant, workspace.flavor, workspace.gpus)
    job = jobs.job_queue_locked(
        tenant=workspace.tenant, environment=environment, flavor=workspace.flavor,
        spec=job_spec(workspace, preemptible=preemptible), submitted_by=workspace.owner, actor=actor,
        kind=Job.Kind.WORKSPACE, event_reason=f"Workspace {workspace.name}: {why}")
    Workspace.objects.filter(id=workspace.id).update(
        job=job, key=new_key(), address="", state=WorkspaceState.QUEUED, ready_at=None, busy_seen_at=None,
        last_activity_at=None, reason=why + (" It borrows beyond the guarantee: another tenant's guaranteed work "
                                             "may preempt it." if preemptible else ""),
        state_changed_at=timezone.now())
    workspace.refresh_from_db()
    return workspace


def workspace_start(*, actor: AbstractBaseUser, workspace: Workspace) -> Workspace:
    with transaction.atomic():
        workspace = _locked(workspace)
        _may_drive(actor, workspace)
        workspace = _start_locked(workspace, actor=actor, why=f"Started by {actor.get_username()}.")
        record("workspace.started", actor=actor, tenant=workspace.tenant, obj=workspace, object_repr=workspace.name,
               after={"job": workspace.job_id, "preemptible": workspace.job.preemptible})
    return workspace


def _may_drive(actor, workspace: Workspace) -> None:
    """Starting, stopping and deleting: its owner, or an admin of its tenant."""
    if actor.id != workspace.owner_id:
        require_role(user=actor, tenant=workspace.tenant, at_least=Role.ADMIN)


def _stop_locked(workspace: Workspace, why: str) -> Workspace:
    job = workspace.job
    if job is None or job.state in JOB_FINAL_STATES:
        Workspace.objects.filter(id=workspace.id).update(state=WorkspaceState.STOPPED, address="", reason=why,
                                                         state_changed_at=timezone.now())
    else:
        job = Job.objects.select_for_update(of=("self",)).get(id=job.id)
        jobs.job_cancel_locked(job, f"Workspace {workspace.name}: {why}", final_is_conflict=False)
        if job.state == JobState.CANCELLING:
            job_id = job.id
            transaction.on_commit(lambda: jobs.send_job_stop(job_id))
        transaction.on_commit(jobs.kick_cycle)
        state = WorkspaceState.STOPPED if job.state in JOB_FINAL_STATES else WorkspaceState.STOPPING
        Workspace.objects.filter(id=workspace.id).update(state=state, address="", reason=why,
                                                         state_changed_at=timezone.now())
    workspace.refresh_from_db()
    return workspace


def workspace_stop(*, actor: AbstractBaseUser, workspace: Workspace) -> Workspace:
    with transaction.atomic():
        workspace = _locked(workspace)
        _may_drive(actor, workspace)
        before = workspace.state
        workspace = _stop_locked(workspace, f"Stopped by {actor.get_username()}.")
        record("workspace.stopped", actor=actor, tenant=workspace.tenant, obj=workspace, object_repr=workspace.name,
               before={"state": before}, after={"state": workspace.state})
    return workspace


def workspace_delete(*, actor: AbstractBaseUser, workspace: Workspace) -> None:
    """Delete a stopped workspace (its home folder with it, by the backend); one that runs is a 409."""
    with transaction.atomic():
        workspace = _locked(workspace)
        _may_drive(actor, workspace)
        if workspace.job_id is not None and workspace.job.state not in JOB_FINAL_STATES:
            raise Conflict(f"Workspace {workspace.name} is {workspace.state}; stop it first.")
        record("workspace.deleted", actor=actor, tenant=workspace.tenant, obj=workspace, object_repr=workspace.name,
               before={"state": workspace.state})
        home = home_of(workspace)
        workspace.delete()
        transaction.on_commit(lambda: send_task("runners.tasks.workspace_home_delete", home))


def home_of(workspace: Workspace) -> str:
    """The workspace's home folder as the backend names it: kept across starts, gone with the workspace."""
    return f"{workspace.tenant.slug}/{workspace.id}"


def kick_reconcile() -> None:
    send_task_at_most_every(1, "runners.tasks.workspaces_reconcile", timezone.now().timestamp())


# --- the pass: readiness, activity and the idle cull -----------------------------------------------


def idle_limit(workspace: Workspace) -> timedelta:
    return timedelta(minutes=workspace.idle_minutes or settings.WORKSPACE_IDLE_MINUTES)


def idle_since(workspace: Workspace):
    """When the workspace last did anything: JupyterLab's own last activity, a kernel seen busy, its start."""
    marks = [mark for mark in (workspace.last_activity_at, workspace.busy_seen_at, workspace.ready_at) if mark]
    return max(marks) if marks else None


def observe(workspace_id: int, *, job_state: str, address: str | None, status: dict | None, now=None) -> str:
    """Write what the pass saw of one workspace: its job's state, where its server answers and what the server
    said of itself (``status``: {"last_activity": datetime, "busy": bool}, None when it did not answer).
    Returns the workspace's state after it, "culled" when the idle cull stopped it."""
    now = now or timezone.now()
    with transaction.atomic():
        workspace = Workspace.objects.select_for_update(of=("self",)).filter(id=workspace_id).select_related(
            "tenant", "owner", "job").first()
        if workspace is None or workspace.job is None:
            return "gone"
        job = workspace.job
        fields: dict = {}
        if job.state in JOB_FINAL_STATES:
            state = WorkspaceState.FAILED if job.state == JobState.FAILED else WorkspaceState.STOPPED
            if workspace.state != state:
                fields.update(state=state, address="", reason=job.reason[:1000] if state == WorkspaceState.FAILED
                              else workspace.reason)
        elif job.state in (JobState.CANCELLING,):
            fields.update(state=WorkspaceState.STOPPING, address="")
        elif job.state == JobState.PREEMPTED:
            if workspace.state != WorkspaceState.STOPPING:
                why = (f"Preempted: {job.reason} Its files are kept; it waits in the queue to start again.")[:1000]
                fields.update(state=WorkspaceState.STOPPING, address="", reason=why)
                signals.workspace_stopped.send(sender=Workspace, workspace=workspace, reason=why, cause="preempted")
        elif job.state in (JobState.QUEUED, JobState.ADMITTED, JobState.LAUNCHING):
            if workspace.state not in (WorkspaceState.QUEUED,):
                fields.update(state=WorkspaceState.QUEUED, address="")
        elif job.state == JobState.RUNNING:
            if status is None or not address:
                silent_s = (now - workspace.answered_at).total_seconds() if workspace.answered_at else None
                if workspace.state == WorkspaceState.READY:
                    if silent_s is None or silent_s >= settings.WORKSPACE_UNANSWERED_S:
                        fields.update(state=WorkspaceState.STARTING, address="",
                                      reason="JupyterLab stopped answering.")
                elif workspace.state != WorkspaceState.STARTING:
                    fields.update(state=WorkspaceState.STARTING, address="", reason="JupyterLab is starting.")
            else:
                fields["answered_at"] = now
                if workspace.state != WorkspaceState.READY or workspace.address != address:
                    fields.update(state=WorkspaceState.READY, address=address, reason="JupyterLab answers.")
                    if workspace.ready_at is None:
                        fields["ready_at"] = now
                        workspace.ready_at = now
                if status.get("last_activity"):
                    fields["last_activity_at"] = status["last_activity"]
                    workspace.last_activity_at = status["last_activity"]
                if status.get("busy"):
                    fields["busy_seen_at"] = now
                    workspace.busy_seen_at = now
                since = idle_since(workspace)
                if since is not None and now - since >= idle_limit(workspace):
                    minutes = round((now - since).total_seconds() / 60, 1)
                    if fields:
                        Workspace.objects.filter(id=workspace.id).update(**fields)
                        workspace.refresh_from_db()
                    why = f"Idle for {minutes} minutes (its limit is {idle_limit(workspace).total_seconds() / 60:g})."
                    _stop_locked(workspace, why)
                    record("workspace.culled", actor=SYSTEM, tenant=workspace.tenant, obj=workspace,
                           object_repr=workspace.name, after={"idle_minutes": minutes})
                    signals.workspace_stopped.send(sender=Workspace, workspace=workspace, reason=why, cause="idle")
                    return "culled"
        if fields.get("state", workspace.state) != workspace.state:
            fields["state_changed_at"] = now
        if fields:
            Workspace.objects.filter(id=workspace.id).update(**fields)
        return fields.get("state", workspace.state)
