"""Jobs: the submitted spec checked field by field, the one state machine, submit and cancel.

A job's state changes only through ``transition`` (or its bulk form ``transition_locked``),
which checks the move is allowed, writes the new state and reason, and records a JobEvent in
the same transaction.
Scheduling is ``runners.cycle``; launching and watching attempts is ``runners.launch``.
"""

from __future__ import annotations

import re

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import connection, transaction
from django.utils import timezone

from portal.errors import Conflict, Invalid
from quotas.models import PartitionKind, Quota, ResourceFlavor
from runners.models import (
    JOB_FINAL_STATES,
    Environment,
    EnvironmentState,
    Job,
    JobEvent,
    JobState,
)
from tenants.models import Role, Tenant
from tenants.selectors import tenant_list
from tenants.services import require_role

# --- The spec ---------------------------------------------------------------------

TEMPLATES = ("pytorch-ddp", "custom")
TOPOLOGY_LEVELS = ("none", "node", "nvlink", "rack")
TOPOLOGY_MODES = ("required", "preferred")
MAX_REPLICAS = 64
MAX_STEPS = 10_000_000
MAX_RUNTIME_S = 30 * 24 * 3600
MAX_RETRIES = 20
MAX_ENV_VARIABLES = 64
MAX_ENV_VALUE = 4096
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Set by the portal for every replica, or able to change what runs on the host: never a tenant's.
RESERVED_ENV_NAMES = {
    "CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "PATH", "HOME",
}
RESERVED_ENV_PREFIXES = ("NVIDIA_", "PORTAL_", "PYTHON", "LD_", "TORCH_", "NCCL_", "TRAIN_JOB_DIR", "TRAIN_STEPS",
                         "TRAIN_CHECKPOINT_EVERY", "TRAIN_MAX_RUNTIME_S", "TRAIN_CORPUS")
DEFAULTS = {
    "template": "pytorch-ddp", "replicas": 1, "gpus_per_replica": 1, "cpu_milli_per_replica": 2000,
    "memory_mib_per_replica": 4096, "topology": {"level": "none", "mode": "preferred"}, "priority": 0,
    "preemptible": True, "steps": 200, "checkpoint_every_steps": 50, "max_runtime_s": 3600, "max_retries": 3,
    "env": {}, "image": None, "command": None,
}
REQUIRED = ("tenant", "environment", "name", "flavor")
FIELDS = (*REQUIRED, *DEFAULTS)


def _integer(data: dict, field: str, low: int, high: int) -> int:
    value = data[field]
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(field, f"Must be a whole number, got {value!r}.")
    if not low <= value <= high:
        raise Invalid(field, f"Must be between {low} and {high}, got {value}.")
    return value


def _env(value) -> dict[str, str]:
    if not isinstance(value, dict):
        raise Invalid("env", "Must be an object of variable names to string values.")
    if len(value) > MAX_ENV_VARIABLES:
        raise Invalid("env", f"At most {MAX_ENV_VARIABLES} variables.")
    for name, text in value.items():
        if not ENV_NAME.match(name):
            raise Invalid("env", f"{name!r} is not a variable name (letters, digits and _, not starting with a digit).")
        if name.upper() in RESERVED_ENV_NAMES or name.upper().startswith(RESERVED_ENV_PREFIXES):
            raise Invalid("env", f"{name} is set by the portal and cannot be given.")
        if not isinstance(text, str) or len(text) > MAX_ENV_VALUE or "\x00" in text:
            raise Invalid("env", f"{name}: the value must be a string of at most {MAX_ENV_VALUE} characters.")
    return dict(value)


def _topology(value) -> dict[str, str]:
    if not isinstance(value, dict):
        raise Invalid("topology", 'Must be an object: {"level": ..., "mode": ...}.')
    unknown = sorted(set(value) - {"level", "mode"})
    if unknown:
        raise Invalid(f"topology.{unknown[0]}", "Unknown field.")
    level, mode = value.get("level", "none"), value.get("mode", "required")
    if level not in TOPOLOGY_LEVELS:
        raise Invalid("topology.level", f"Use one of {', '.join(TOPOLOGY_LEVELS)}.")
    if mode not in TOPOLOGY_MODES:
        raise Invalid("topology.mode", f"Use one of {', '.join(TOPOLOGY_MODES)}.")
    return {"level": level, "mode": mode}


def _image(image, command) -> tuple[str, list[str]]:
    if not isinstance(image, str) or not image:
        raise Invalid("image", "A custom job names its image.")
    registries = settings.ALLOWED_IMAGE_REGISTRIES
    if not any(image.startswith(registry.rstrip("/") + "/") for registry in registries):
        raise Invalid("image", f"Images come from {', '.join(registries) or 'no registry (none is allowed)'}.")
    if not re.fullmatch(r"[a-z0-9][a-z0-9._\-/:@]{0,254}", image):
        raise Invalid("image", "Not an image reference.")
    if command is None or not isinstance(command, list) or not command or not all(
        isinstance(part, str) and len(part) <= 4096 for part in command
    ):
        raise Invalid("command", "A custom job gives its command as a non-empty list of strings.")
    return image, command


def job_spec_check(*, actor: AbstractBaseUser, data) -> dict:
    """The submitted spec, checked and completed with defaults; Invalid names the first bad field.

    Exactly the API's shape: an unknown field (``privileged``, ``nodeSelector``,
    ``schedulerName``, ...) is refused rather than ignored, because pod specs are the
    server's to build.
    """
    if not isinstance(data, dict):
        raise Invalid("non_field_errors", "A job is a JSON object.")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise Invalid(unknown[0], "Unknown field.")
    for field in REQUIRED:
        if data.get(field) in (None, ""):
            raise Invalid(field, "This field is required.")
    spec = {**DEFAULTS, **{key: value for key, value in data.items() if value is not None or key in ("image", "command")}}
    try:
        tenant = tenant_list(user=actor).get(slug=spec["tenant"]) if isinstance(spec["tenant"], str) else None
    except Tenant.DoesNotExist:
        tenant = None
    if tenant is None:
        raise Invalid("tenant", "No such tenant.")
    require_role(user=actor, tenant=tenant, at_least=Role.MEMBER)
    if isinstance(spec["environment"], bool) or not isinstance(spec["environment"], int) or not (
        0 < spec["environment"] < 2**31
    ):
        raise Invalid("environment", "An environment id.")
    environment = Environment.objects.filter(id=spec["environment"], tenant=tenant).first()
    if environment is None:
        raise Invalid("environment", f"Tenant {tenant.slug} has no environment {spec['environment']}.")
    if environment.state != EnvironmentState.READY:
        raise Invalid("environment", f"Environment {environment.name} is {environment.state}, not ready.")
    name = spec["name"]
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?", name):
        raise Invalid("name", "Lowercase letters, digits and '-', at most 40, starting and ending alphanumeric.")
    if spec["template"] not in TEMPLATES:
        raise Invalid("template", f"Use one of {', '.join(TEMPLATES)}.")
    if spec["template"] == "custom":
        if settings.CLUSTER_BACKEND != "kubernetes":
            raise Invalid("template", "Custom images run on the Kubernetes backend only; this portal runs pytorch-ddp.")
        spec["image"], spec["command"] = _image(spec["image"], spec["command"])
    elif spec["image"] is not None or spec["command"] is not None:
        raise Invalid("image" if spec["image"] is not None else "command", "Only custom jobs take an image and command.")
    _integer(spec, "replicas", 1, MAX_REPLICAS)
    flavor = ResourceFlavor.objects.filter(name=spec["flavor"]).first() if isinstance(spec["flavor"], str) else None
    quota = Quota.objects.filter(tenant=tenant, flavor=flavor).first() if flavor else None
    if quota is None:
        raise Invalid("flavor", f"Tenant {tenant.slug} has no quota for flavor {spec['flavor']!r}.")
    sliced = flavor.kind in (PartitionKind.MIG, PartitionKind.TIMESLICE)
    _integer(spec, "gpus_per_replica", 1, 1 if sliced else 64)
    units = spec["replicas"] * spec["gpus_per_replica"]
    if units > quota.max:
        raise Invalid(
            "gpus_per_replica", f"{units} units of {flavor.name} in all is past tenant {tenant.slug}'s max of {quota.max}."
        )
    _integer(spec, "cpu_milli_per_replica", 100, 512_000)
    _integer(spec, "memory_mib_per_replica", 128, 4 * 1024 * 1024)
    spec["topology"] = _topology(spec["topology"])
    _integer(spec, "priority", 0, 1000)
    if spec["priority"] > quota.max_priority:
        raise Invalid("priority", f"At most {quota.max_priority} for tenant {tenant.slug} on {flavor.name}.")
    if not isinstance(spec["preemptible"], bool):
        raise Invalid("preemptible", "true or false.")
    if not spec["preemptible"] and units > quota.guaranteed:
        raise Invalid(
            "preemptible",
            f"A non-preemptible job runs only within the guarantee: it needs {units} units of {flavor.name} and "
            f"tenant {tenant.slug} is guaranteed {quota.guaranteed}. Make it preemptible to borrow idle GPUs.",
        )
    _integer(spec, "steps", 1, MAX_STEPS)
    _integer(spec, "checkpoint_every_steps", 0, spec["steps"])
    _integer(spec, "max_runtime_s", 10, MAX_RUNTIME_S)
    _integer(spec, "max_retries", 0, MAX_RETRIES)
    spec["env"] = _env(spec["env"])
    return {"spec": spec, "tenant": tenant, "environment": environment, "flavor": flavor}


# --- The state machine ------------------------------------------------------------

ALLOWED = {
    JobState.QUEUED: {JobState.ADMITTED, JobState.CANCELLED, JobState.FAILED},
    JobState.ADMITTED: {JobState.LAUNCHING, JobState.QUEUED, JobState.CANCELLED, JobState.FAILED},
    JobState.LAUNCHING: {JobState.RUNNING, JobState.QUEUED, JobState.CANCELLING, JobState.FAILED, JobState.SUCCEEDED,
                         JobState.PREEMPTED},
    JobState.RUNNING: {JobState.SUCCEEDED, JobState.FAILED, JobState.QUEUED, JobState.PREEMPTED, JobState.CANCELLING},
    JobState.PREEMPTED: {JobState.QUEUED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLING},
    JobState.CANCELLING: {JobState.CANCELLED},
}


def transition(job: Job, to: str, reason: str, **fields) -> bool:
    """Move a job to `to` if it is still in the state this copy holds; record the event.

    A compare-and-set on the state: False (nothing written) when another writer moved it
    first. Raises ValueError for a move the machine does not allow (a bug, not input).
    """
    if to not in ALLOWED.get(job.state, set()):
        raise ValueError(f"Job {job.id}: {job.state} -> {to} is not a transition")
    now = timezone.now()
    if to in JOB_FINAL_STATES:
        fields.setdefault("finished_at", now)
    if to == JobState.RUNNING and job.started_at is None:
        fields.setdefault("started_at", now)
    if to != JobState.QUEUED:
        fields.setdefault("queue_position", None)
    with transaction.atomic():
        moved = Job.objects.filter(id=job.id, state=job.state).update(
            state=to, reason=reason[:1000], state_changed_at=now, **fields
        )
        if moved:
            JobEvent.objects.create(job=job, from_state=job.state, to_state=to, reason=reason[:1000])
    if moved:
        job.state, job.reason, job.state_changed_at = to, reason[:1000], now
        for key, value in fields.items():
            setattr(job, key, value)
    return bool(moved)


def transition_locked(jobs: list[Job], to: str, reasons: dict[int, str]) -> None:
    """The bulk form of ``transition`` for jobs whose rows the caller holds locked (select_for_update).

    The scheduler cycle admits hundreds of jobs at once: one UPDATE and one INSERT of events
    instead of two statements per job. Every move is checked against the same machine.
    """
    now = timezone.now()
    events = []
    for job in jobs:
        if to not in ALLOWED.get(job.state, set()):
            raise ValueError(f"Job {job.id}: {job.state} -> {to} is not a transition")
        reason = reasons[job.id][:1000]
        events.append(JobEvent(job=job, from_state=job.state, to_state=to, reason=reason))
        job.state, job.reason, job.state_changed_at = to, reason, now
        if to != JobState.QUEUED:
            job.queue_position = None
    job_rows_update(jobs, ["state", "reason", "queue_position", "state_changed_at"])
    JobEvent.objects.bulk_create(events, batch_size=1000)


def job_rows_update(jobs: list[Job], fields: list[str], *, only_in_state: str | None = None) -> None:
    """Write these fields of many jobs in one statement per 1,000 (PostgreSQL: UPDATE ... FROM VALUES).

    ``only_in_state``: leave alone a job that has meanwhile left that state (say, a waiting job
    cancelled while the cycle ran: its reason must stay the cancel's).

    Django's bulk_update builds a CASE per field and row, which costs seconds for a cycle that
    admits or re-explains a thousand jobs; other databases still get it.
    """
    if not jobs:
        return
    if connection.vendor != "postgresql":
        if only_in_state is not None:
            current = set(Job.objects.filter(id__in=[job.id for job in jobs], state=only_in_state)
                          .values_list("id", flat=True))
            jobs = [job for job in jobs if job.id in current]
        Job.objects.bulk_update(jobs, fields, batch_size=500)
        return
    table = Job._meta.db_table
    columns = [Job._meta.get_field(name) for name in fields]
    casts = [column.db_type(connection) for column in columns]
    assignments = ", ".join(f'"{column.column}" = v."{column.column}"' for column in columns)
    names = ", ".join(f'"{column.column}"' for column in columns)
    with connection.cursor() as cursor:
        for start in range(0, len(jobs), 1000):
            chunk = jobs[start:start + 1000]
            rows = ", ".join(
                "(%s::bigint, " + ", ".join(f"%s::{cast}" for cast in casts) + ")" for _ in chunk
            )
            params = []
            for job in chunk:
                params.append(job.id)
                params.extend(column.get_db_prep_save(getattr(job, column.attname), connection) for column in columns)
            condition = ""
            if only_in_state is not None:
                condition = " AND j.state = %s"
                params.append(only_in_state)
            cursor.execute(
                f'UPDATE "{table}" AS j SET {assignments} FROM (VALUES {rows}) AS v(id, {names}) '
                f"WHERE j.id = v.id{condition}",
                params,
            )


# --- Submit, cancel, read -----------------------------------------------------------


def job_submit(*, actor: AbstractBaseUser, data) -> Job:
    """Check and queue a job; the scheduler cycle is kicked after commit."""
    from runners.cycle import kick_cycle

    checked = job_spec_check(actor=actor, data=data)
    spec = checked["spec"]
    with transaction.atomic():
        job = Job.objects.create(
            tenant=checked["tenant"], environment=checked["environment"], name=spec["name"], spec=spec,
            flavor=checked["flavor"], replicas=spec["replicas"], gpus_per_replica=spec["gpus_per_replica"],
            priority=spec["priority"], preemptible=spec["preemptible"], submitted_by=actor,
            reason="Waiting for the scheduler.",
        )
        JobEvent.objects.create(job=job, to_state=JobState.QUEUED, reason=f"Submitted by {actor.get_username()}.")
        transaction.on_commit(kick_cycle)
    return job


def job_cancel(*, actor: AbstractBaseUser, job: Job) -> Job:
    """Cancel a job: at once while it waits; with the grace period once it runs."""
    from runners.cycle import kick_cycle
    from runners.launch import stop_attempt

    require_role(user=actor, tenant=job.tenant, at_least=Role.MEMBER)
    reason = f"Cancelled by {actor.get_username()}."
    with transaction.atomic():
        job = Job.objects.select_for_update().get(id=job.id)
        if job.state in JOB_FINAL_STATES:
            raise Conflict(f"Job {job.name} has already {job.state}.")
        if job.state == JobState.CANCELLING:
            return job
        if job.state in (JobState.QUEUED, JobState.ADMITTED):
            attempt = job.attempts.filter(ended_at__isnull=True).first()
            if attempt is not None:  # admitted, never launched
                attempt.outcome, attempt.ended_at, attempt.reason = "cancelled", timezone.now(), reason
                attempt.save(update_fields=["outcome", "ended_at", "reason"])
            transition(job, JobState.CANCELLED, reason)
        else:
            deadline = timezone.now() + timezone.timedelta(seconds=settings.PREEMPTION_GRACE_PERIOD_S)
            transition(job, JobState.CANCELLING, reason, stop_deadline=deadline)
            transaction.on_commit(lambda: stop_attempt(job.id))
        transaction.on_commit(kick_cycle)
    return job
