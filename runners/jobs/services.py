"""Jobs: the submitted spec checked field by field, the one state machine, submit and cancel.

A job's state changes only through ``transition`` (or its bulk form ``transition_locked``),
which checks the move is allowed, writes the new state and reason, and records a JobEvent in
the same transaction. This app owns the Job rows: every job is queued by ``job_queue_locked``
(a submit, an endpoint's replica), and other apps write them only through its functions
(``job_rows_update``, ``job_preemptible_set``, ``runners.jobs.attempts``), each of which re-reads
state and ``preemptible`` under the row lock. Rows held together are locked in id order
(``jobs_locked``).
Scheduling is ``runners.scheduling.services``; an attempt's life is ``runners.jobs.attempts`` and the reconcile ``runners.jobs.reconcile``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from datetime import datetime

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from audit.services import record
from common.dispatch import send_task, send_task_at_most_every
from common.errors import Conflict, Invalid, TooMany
from common.images import allowed_image
from quotas.models import PartitionKind, Quota, ResourceFlavor
from runners.bundles import services as bundles
from runners.clusters.models import Node
from runners.clusters.services import flavor_units_per_node
from runners.datasets import services as datasets
from runners.environments.models import Environment, EnvironmentState
from runners.jobs import signals
from runners.jobs.models import JOB_FINAL_STATES, NOT_YET_SEEN_REASON, IdempotencyKey, Job, JobEvent, JobState
from runners.storage import retention
from runners.workloads import env_policy
from runners.workloads.env_policy import TRAINER_MIN_MEMORY_MIB
from tenants.models import Role, Tenant
from tenants.selectors import tenant_list
from tenants.services import require_role


def send_job_stop(job_id: int) -> None:
    """Ask a worker to tell the job's attempt to checkpoint and stop (call it after commit)."""
    send_task("runners.tasks.job_stop", job_id)


def kick_cycle() -> None:
    """Ask for a scheduling cycle soon (after a submit, a cancel, an attempt's end); asks within a
    second of each other send one message, and the beat runs the cycle anyway."""
    send_task_at_most_every(1, "runners.tasks.scheduler_cycle", time.time())


# --- The spec ---------------------------------------------------------------------

# pytorch-ddp: the shipped trainer; script: the tenant's `command` run in its code bundle (either backend);
# custom: an image and its command (Kubernetes only).
TEMPLATES = ("pytorch-ddp", "script", "custom")
TOPOLOGY_LEVELS = ("none", "node", "nvlink", "rack")
TOPOLOGY_MODES = ("required", "preferred")
# A topology given without a mode is a preference: the gang is placed together when it can be,
# spread when it cannot. "required" must be asked for.
DEFAULT_TOPOLOGY_MODE = "preferred"
# Job names become object names (job-<id>-<attempt>, the rendezvous Service) with room to spare.
NAME_MAX = 40
NAME_PATTERN = rf"[a-z0-9]([-a-z0-9]{{0,{NAME_MAX - 2}}}[a-z0-9])?"
MAX_STEPS = 10_000_000
MAX_RUNTIME_S = 30 * 24 * 3600
MAX_ENV_VARIABLES = 64
MAX_ENV_VALUE = 4096
DEFAULT_CHECKPOINT_EVERY_STEPS = 50
# The one table of every whole-number field's bounds: the spec check enforces it and the API's
# schema (runners.jobs.api.JobSubmitSerializer) is generated from it, so the two cannot drift.
BOUNDS = {
    "replicas": (1, 64),
    "gpus_per_replica": (1, 64),  # 1 for MIG and time-slice flavors
    "cpu_milli_per_replica": (100, 512_000),
    "memory_mib_per_replica": (128, 4 * 1024 * 1024),
    "priority": (0, 1000),
    "steps": (1, MAX_STEPS),
    "checkpoint_every_steps": (0, MAX_STEPS),  # and at most steps
    "max_runtime_s": (10, MAX_RUNTIME_S),
    "max_retries": (0, 20),
}
MAX_REPLICAS = BOUNDS["replicas"][1]
MAX_RETRIES = BOUNDS["max_retries"][1]
# The shipped trainer's settings a spec may give (pytorch-ddp only): (type, low, high, default).
HYPERPARAMETERS = {
    "lr": (float, 1e-6, 1.0, 0.003),
    "batch_size": (int, 1, 1024, 32),
    "seq_len": (int, 8, 512, 64),
    "seed": (int, 0, 2**31 - 1, 0),
}
# How many checkpoint files the trainer keeps: the portal's choice, never a tenant's (disk is shared).
TRAINER_KEEP_CHECKPOINTS = 3
# A command: at most this many arguments, each at most COMMAND_ARG_MAX characters, COMMAND_MAX_CHARS in all.
COMMAND_MAX_ARGS = 256
COMMAND_ARG_MAX = 4096
COMMAND_MAX_CHARS = 32 * 1024
# A script job's hyperparameters: any JSON object, at most this long written as JSON.
SCRIPT_HYPERPARAMETERS_MAX_BYTES = 16 * 1024
# A bundle is named by its content digest: SHA-256, 64 lowercase hex digits.
BUNDLE_PATTERN = r"[0-9a-f]{64}"
DEFAULTS = {
    "template": "pytorch-ddp", "replicas": 1, "gpus_per_replica": 1, "cpu_milli_per_replica": 2000,
    "memory_mib_per_replica": 4096, "topology": {"level": "none", "mode": DEFAULT_TOPOLOGY_MODE}, "priority": 0,
    "preemptible": True, "steps": 200, "checkpoint_every_steps": None, "max_runtime_s": 3600, "max_retries": 3,
    "env": {}, "hyperparameters": {}, "image": None, "command": None, "bundle": None,
    # The dataset versions the job reads: [{"name": ..., "version": N}], pinned to numbers at submit.
    "datasets": [],
    # The job's own checkpoint retention (runners.storage.retention); None follows the tenant's.
    "checkpoint_retention": None,
}
REQUIRED = ("tenant", "environment", "name", "flavor")
FIELDS = (*REQUIRED, *DEFAULTS)


def _integer(data: dict, field: str, low: int | None = None, high: int | None = None) -> int:
    """The field as a whole number within its bounds (BOUNDS unless narrower ones are given)."""
    low = BOUNDS[field][0] if low is None else low
    high = BOUNDS[field][1] if high is None else high
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
        refused = env_policy.refusal(name) if isinstance(name, str) else "Not a variable name."
        if refused:
            raise Invalid("env", f"{name!r}: {refused}")
        if not isinstance(text, str) or len(text) > MAX_ENV_VALUE or "\x00" in text:
            raise Invalid("env", f"{name}: the value must be a string of at most {MAX_ENV_VALUE} characters.")
    return dict(value)


def _script_hyperparameters(value) -> dict:
    """A script job's hyperparameters: any JSON object (handed to the script as PORTAL_HYPERPARAMETERS), bounded."""
    if not isinstance(value, dict):
        raise Invalid("hyperparameters", "Must be a JSON object (the script reads it as PORTAL_HYPERPARAMETERS).")
    try:
        text = json.dumps(value, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError):
        raise Invalid("hyperparameters", "Must be plain JSON: objects, lists, strings, finite numbers, "
                                         "true, false and null.") from None
    if len(text.encode()) > SCRIPT_HYPERPARAMETERS_MAX_BYTES:
        raise Invalid("hyperparameters", f"At most {SCRIPT_HYPERPARAMETERS_MAX_BYTES} bytes written as JSON.")
    return json.loads(text)


def command_check(command) -> list[str]:
    """A command as an argument list, checked (Invalid names ``command``): it is run as given, never by a shell."""
    if isinstance(command, str):
        raise Invalid("command", 'Give the command as a list of arguments, e.g. ["python", "train.py", "--epochs", '
                                 '"3"], not as a string: it is never run through a shell.')
    if not isinstance(command, list) or not command:
        raise Invalid("command", 'A non-empty list of arguments, e.g. ["python", "train.py"].')
    if len(command) > COMMAND_MAX_ARGS:
        raise Invalid("command", f"At most {COMMAND_MAX_ARGS} arguments, got {len(command)}.")
    for index, part in enumerate(command):
        if not isinstance(part, str) or not part:
            raise Invalid("command", f"Argument {index} must be a non-empty string.")
        if len(part) > COMMAND_ARG_MAX or "\x00" in part:
            raise Invalid("command", f"Argument {index} must be at most {COMMAND_ARG_MAX} characters, with no NUL.")
    if sum(len(part) for part in command) > COMMAND_MAX_CHARS:
        raise Invalid("command", f"At most {COMMAND_MAX_CHARS} characters in all.")
    return list(command)


class UnknownBundle(Invalid):
    """A spec names a bundle the tenant does not have (none with that digest, deleted, or another tenant's):
    a field error to a form, a 404 naming ``bundle`` to the API."""

    def __init__(self, tenant: Tenant, sha256: str):
        super().__init__("bundle", f"Tenant {tenant.slug} has no bundle {sha256}.")


def bundle_check(tenant: Tenant, sha256, *, for_update: bool = False):
    """The tenant's bundle a spec names (runners.bundles): Invalid naming ``bundle`` for a digest that is not one,
    UnknownBundle for one the tenant does not have.

    Another tenant's bundle is answered exactly as one that does not exist (the same 404, the same words):
    nothing says it is there.
    """
    if not isinstance(sha256, str) or not re.fullmatch(BUNDLE_PATTERN, sha256):
        raise Invalid("bundle", "A bundle's SHA-256 digest: 64 lowercase hex digits.")
    try:
        return bundles.get_bundle(tenant, sha256, for_update=for_update)
    except bundles.Bundle.DoesNotExist:
        raise UnknownBundle(tenant, sha256) from None


def _hyperparameters(value, template: str) -> dict:
    if template == "script":
        return _script_hyperparameters(value)
    if not isinstance(value, dict):
        raise Invalid("hyperparameters", f"Must be an object with any of {', '.join(HYPERPARAMETERS)}.")
    unknown = sorted(set(value) - set(HYPERPARAMETERS))
    if unknown:
        raise Invalid(f"hyperparameters.{unknown[0]}", f"Unknown; use {', '.join(HYPERPARAMETERS)}.")
    if value and template != "pytorch-ddp":
        raise Invalid("hyperparameters", "Only the pytorch-ddp template takes hyperparameters.")
    checked = {}
    for name, (kind, low, high, default) in HYPERPARAMETERS.items():
        given = value.get(name, default)
        if isinstance(given, bool) or not isinstance(given, (int, float)) or (kind is int and not isinstance(given, int)):
            raise Invalid(f"hyperparameters.{name}", f"Must be a {'whole ' if kind is int else ''}number.")
        if not low <= given <= high:
            raise Invalid(f"hyperparameters.{name}", f"Must be between {low} and {high}, got {given}.")
        checked[name] = kind(given)
    return checked


def _topology(value) -> dict[str, str]:
    if not isinstance(value, dict):
        raise Invalid("topology", 'Must be an object: {"level": ..., "mode": ...}.')
    unknown = sorted(set(value) - {"level", "mode"})
    if unknown:
        raise Invalid(f"topology.{unknown[0]}", "Unknown field.")
    level, mode = value.get("level", "none"), value.get("mode", DEFAULT_TOPOLOGY_MODE)
    if level not in TOPOLOGY_LEVELS:
        raise Invalid("topology.level", f"Use one of {', '.join(TOPOLOGY_LEVELS)}.")
    if mode not in TOPOLOGY_MODES:
        raise Invalid("topology.mode", f"Use one of {', '.join(TOPOLOGY_MODES)}.")
    return {"level": level, "mode": mode}


def image_check(image, command) -> tuple[str, list[str]]:
    """An image and command as a spec gives them, checked (Invalid names ``image`` or ``command``)."""
    return allowed_image("image", image), command_check(command)


def spec_shape_check(data, *, fields, required, what: str) -> None:
    """A spec is a JSON object of exactly these fields, the required ones given: an unknown field is refused by
    name, never ignored (pod specs are the server's to build); Invalid names the first that is wrong."""
    if not isinstance(data, dict):
        raise Invalid("non_field_errors", f"{what} is a JSON object.")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise Invalid(unknown[0], "Unknown field.")
    for field in required:
        if data.get(field) in (None, ""):
            raise Invalid(field, "This field is required.")


def member_tenant_and_ready_environment(actor: AbstractBaseUser, tenant_slug, environment_id) -> tuple:
    """(tenant, environment) of a spec: a tenant the actor is a member of (or above), one of its ready
    environments; Invalid names ``tenant`` or ``environment`` otherwise. Shared by every kind of work."""
    tenant = tenant_list(user=actor).filter(slug=tenant_slug).first() if isinstance(tenant_slug, str) else None
    if tenant is None:
        raise Invalid("tenant", "No such tenant.")
    require_role(user=actor, tenant=tenant, at_least=Role.MEMBER)
    if isinstance(environment_id, bool) or not isinstance(environment_id, int) or not 0 < environment_id < 2**31:
        raise Invalid("environment", "An environment id.")
    environment = Environment.objects.filter(id=environment_id, tenant=tenant).first()
    if environment is None:
        raise Invalid("environment", f"Tenant {tenant.slug} has no environment {environment_id}.")
    if environment.state != EnvironmentState.READY:
        raise Invalid("environment", f"Environment {environment.name} is {environment.state}, not ready.")
    return tenant, environment


def flavor_and_quota(tenant: Tenant, flavor_name) -> tuple[ResourceFlavor, Quota]:
    """The flavor a spec names and the tenant's quota for it; Invalid names ``flavor`` when there is none."""
    flavor = ResourceFlavor.objects.filter(name=flavor_name).first() if isinstance(flavor_name, str) else None
    quota = Quota.objects.filter(tenant=tenant, flavor=flavor).first() if flavor else None
    if quota is None:
        raise Invalid("flavor", f"Tenant {tenant.slug} has no quota for flavor {flavor_name!r}.")
    return flavor, quota


def job_spec_check(*, actor: AbstractBaseUser, data) -> dict:
    """The submitted spec, checked and completed with defaults; Invalid names the first bad field.

    Exactly the API's shape: an unknown field (``privileged``, ``nodeSelector``,
    ``schedulerName``, ...) is refused rather than ignored, because pod specs are the
    server's to build.
    """
    spec_shape_check(data, fields=FIELDS, required=REQUIRED, what="A job")
    spec = {**DEFAULTS, **{key: value for key, value in data.items()
                           if value is not None or key in ("image", "command", "bundle")}}
    spec = {key: (dict(value) if isinstance(value, dict) else value) for key, value in spec.items()}
    tenant, environment = member_tenant_and_ready_environment(actor, spec["tenant"], spec["environment"])
    name = spec["name"]
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        raise Invalid("name", f"Lowercase letters, digits and '-', at most {NAME_MAX}, starting and ending alphanumeric.")
    if spec["template"] not in TEMPLATES:
        raise Invalid("template", f"Use one of {', '.join(TEMPLATES)}.")
    bundle = None
    if spec["template"] == "custom":
        if settings.CLUSTER_BACKEND != "kubernetes":
            raise Invalid("template", "Custom images run on the Kubernetes backend only; this portal runs "
                                      "pytorch-ddp and script.")
        spec["image"], spec["command"] = image_check(spec["image"], spec["command"])
    elif spec["template"] == "script":
        if spec["bundle"] is None:
            raise Invalid("bundle", "A script job names its bundle (the SHA-256 of an uploaded bundle).")
        bundle = bundle_check(tenant, spec["bundle"])
        if spec["command"] is None:
            raise Invalid("command", 'A script job gives its command, e.g. ["python", "train.py"].')
        spec["command"] = command_check(spec["command"])
        if spec["image"] is not None:
            if settings.CLUSTER_BACKEND != "kubernetes":
                raise Invalid("image", "An image is for the Kubernetes backend only; here the script runs on the "
                                       "portal's runtime.")
            spec["image"] = image_check(spec["image"], spec["command"])[0]
    elif spec["image"] is not None or spec["command"] is not None:
        raise Invalid("image" if spec["image"] is not None else "command",
                      "Only custom and script jobs take a command (and an image).")
    if spec["template"] != "script" and spec["bundle"] is not None:
        raise Invalid("bundle", "Only script jobs run a bundle.")
    # An omitted version or "latest" becomes the newest sealed one's number, so every attempt reads the same files;
    # a dataset the tenant cannot read is UnknownDataset (a 404 naming datasets), another tenant's alike.
    spec["datasets"], dataset_versions = datasets.spec_pinned(tenant, spec["datasets"])
    _integer(spec, "replicas")
    flavor, quota = flavor_and_quota(tenant, spec["flavor"])
    sliced = flavor.kind in (PartitionKind.MIG, PartitionKind.TIMESLICE)
    _integer(spec, "gpus_per_replica", high=1 if sliced else None)
    units = spec["replicas"] * spec["gpus_per_replica"]
    if units > quota.max:
        raise Invalid(
            "gpus_per_replica", f"{units} units of {flavor.name} in all is past tenant {tenant.slug}'s max of {quota.max}."
        )
    _integer(spec, "cpu_milli_per_replica")
    trainer_floor = TRAINER_MIN_MEMORY_MIB if spec["template"] == "pytorch-ddp" else None
    _integer(spec, "memory_mib_per_replica", low=trainer_floor)
    spec["topology"] = _topology(spec["topology"])
    gang_fits_the_cluster(flavor, replicas=spec["replicas"], gpus_per_replica=spec["gpus_per_replica"],
                          topology=spec["topology"])
    _integer(spec, "priority")
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
    _integer(spec, "steps")
    if spec["checkpoint_every_steps"] is None:
        spec["checkpoint_every_steps"] = min(DEFAULT_CHECKPOINT_EVERY_STEPS, spec["steps"])
    _integer(spec, "checkpoint_every_steps", high=min(spec["steps"], BOUNDS["checkpoint_every_steps"][1]))
    _integer(spec, "max_runtime_s")
    _integer(spec, "max_retries")
    spec["env"] = _env(spec["env"])
    spec["hyperparameters"] = _hyperparameters(spec["hyperparameters"], spec["template"])
    if spec["checkpoint_retention"] is not None:
        try:
            spec["checkpoint_retention"] = retention.parse_policy(spec["checkpoint_retention"]).to_json()
        except ValueError as exc:
            field, _, why = str(exc).partition(": ")
            raise Invalid(field, why) from None
    return {"spec": spec, "tenant": tenant, "environment": environment, "flavor": flavor, "bundle": bundle,
            "datasets": dataset_versions}


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


# The states in which a job keeps a pin: waiting for the admission that uses it (the cycle clears it then).
PIN_KEEPING_STATES = frozenset({JobState.QUEUED, JobState.PREEMPTED})


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
        fields.setdefault("projected_start", None)
    if to not in PIN_KEEPING_STATES:
        # A pin (the place a move reserved) is for the job's next admission: one cancelled, failed or done
        # has none, and its reservation must not keep others off those GPUs until it runs out.
        fields.setdefault("pinned_placement", None)
        fields.setdefault("pinned_until", None)
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
            job.queue_position = job.projected_start = None
        if to not in PIN_KEEPING_STATES:
            job.pinned_placement = job.pinned_until = None  # as in ``transition``: admission uses the pin up
    job_rows_update(jobs, ["state", "reason", "queue_position", "projected_start", "state_changed_at",
                           "pinned_placement", "pinned_until"])
    rows_insert(JobEvent, events)


def jobs_locked(job_ids) -> dict[int, Job]:
    """Lock these jobs' rows, in id order, in one statement, and read them fresh (with their tenants), by id.

    Every writer that holds more than one job's row takes them in id order (the cycle its victims
    and admissions, an endpoint's reconcile its replicas), so two of them never deadlock.
    """
    locked = Job.objects.select_for_update(of=("self",)).select_related("tenant").filter(id__in=list(job_ids))
    return {job.id: job for job in locked.order_by("id")}


# Rows per statement when many are written at once (one JSON parameter each).
ROWS_PER_STATEMENT = 20_000

# The field types whose values pass through json.dumps and jsonb_to_recordset unchanged (a datetime
# as its ISO text). Another type (a Decimal, a UUID, a JSONField with its own encoder) would need
# Django's own conversion: the bulk writers refuse it rather than write it wrong on PostgreSQL only.
_JSON_SAFE_FIELDS = {
    "AutoField", "BigAutoField", "BigIntegerField", "BooleanField", "CharField", "DateTimeField", "ForeignKey",
    "IntegerField", "JSONField", "PositiveIntegerField", "PositiveSmallIntegerField", "SmallIntegerField", "TextField",
}


def _json_safe(fields) -> None:
    for column in fields:
        kind = column.get_internal_type()
        if kind not in _JSON_SAFE_FIELDS or getattr(column, "encoder", None) is not None:
            raise TypeError(f"{column.model.__name__}.{column.name} ({kind}) cannot be written by the bulk writers")


def _json_value(value):
    return value.isoformat() if isinstance(value, datetime) else value


def rows_insert(model, objects: list) -> None:
    """INSERT these new rows of the jobs app (jobs' events, attempts): a statement per 20,000, the rows
    as one JSON parameter (jsonb_to_recordset). The fields are filled as bulk_create fills them (`pre_save`: an auto_now_add time is set on the instance). No ids
    come back.

    bulk_create builds and binds a parameter per field and row, which cost seconds for the
    10,000 attempts and events of one cycle on a large cluster.
    """
    if not objects:
        return
    fields = [column for column in model._meta.concrete_fields if not column.primary_key]
    _json_safe(fields)
    columns = ", ".join(f'"{column.column}"' for column in fields)
    types = ", ".join(f'"{column.column}" {column.db_type(connection)}' for column in fields)
    with connection.cursor() as cursor:
        for start in range(0, len(objects), ROWS_PER_STATEMENT):
            rows = [
                {column.column: _json_value(column.pre_save(instance, True)) for column in fields}
                for instance in objects[start:start + ROWS_PER_STATEMENT]
            ]
            cursor.execute(
                f'INSERT INTO "{model._meta.db_table}" ({columns}) SELECT {columns} '
                f"FROM jsonb_to_recordset(%s::jsonb) AS v({types})",
                [json.dumps(rows)],
            )


def job_rows_update(jobs: list[Job], fields: list[str], *, only_in_state: str | None = None,
                    skip_locked: bool = False) -> None:
    """Write these fields of many jobs: one statement per 20,000, the rows as one JSON parameter.

    ``only_in_state``: leave alone a job that has meanwhile left that state (say, a waiting job
    cancelled while the cycle ran: its reason must stay the cancel's). ``skip_locked``: leave
    alone, and never wait for, a row another transaction holds, for writes that the
    next cycle makes again anyway; the rows written are locked in id order.

    Django's bulk_update builds a CASE per field and row, and UPDATE ... FROM VALUES a parameter per
    field and job: a cycle that re-explains 100,000 waiting jobs spent seconds building either.
    """
    if not jobs:
        return
    columns = [Job._meta.get_field(name) for name in fields]
    _json_safe(columns)
    table = Job._meta.db_table
    assignments = ", ".join(f'"{column.column}" = v."{column.column}"' for column in columns)
    types = ", ".join(f'"{column.column}" {column.db_type(connection)}' for column in columns)
    condition, tail = "", []
    if only_in_state is not None:
        condition, tail = " AND j.state = %s", [only_in_state]
    with connection.cursor() as cursor:
        for start in range(0, len(jobs), ROWS_PER_STATEMENT):
            rows = json.dumps([
                {"id": job.id, **{column.column: _json_value(getattr(job, column.attname)) for column in columns}}
                for job in jobs[start:start + ROWS_PER_STATEMENT]
            ])
            if skip_locked:
                # The rows to write, locked first in id order (so this never deadlocks with another
                # writer that locks in id order), those another transaction holds left out.
                cursor.execute(
                    f'WITH l AS MATERIALIZED (SELECT "id" FROM "{table}" WHERE "id" IN '
                    f"(SELECT (r->>'id')::bigint FROM jsonb_array_elements(%s::jsonb) AS r) "
                    f'ORDER BY "id" FOR UPDATE SKIP LOCKED) '
                    f'UPDATE "{table}" AS j SET {assignments} '
                    f'FROM jsonb_to_recordset(%s::jsonb) AS v("id" bigint, {types}), l '
                    f"WHERE j.id = v.id AND l.id = j.id{condition}",
                    [rows, rows, *tail],
                )
            else:
                cursor.execute(
                    f'UPDATE "{table}" AS j SET {assignments} '
                    f'FROM jsonb_to_recordset(%s::jsonb) AS v("id" bigint, {types}) WHERE j.id = v.id{condition}',
                    [rows, *tail],
                )


# --- Submit, cancel, read -----------------------------------------------------------


def units_text(flavor: ResourceFlavor, count: int) -> str:
    """A count of a flavor's units in words: GPUs, MIG slices or GPU shares."""
    word = {PartitionKind.MIG: "MIG slice", PartitionKind.TIMESLICE: "GPU share"}.get(flavor.kind, "GPU")
    return f"{count} {flavor.name} {word}{'' if count == 1 else 's'}"


# The topology levels whose domains group nodes (a required gang fits in one domain), and the node field naming them.
DOMAIN_FIELDS = {"nvlink": "nvlink_domain", "rack": "rack"}
_DOMAIN_WORDS = {"node": "on one node", "nvlink": "in one NVLink domain", "rack": "in one rack"}


def gang_misfit(flavor: ResourceFlavor, *, replicas: int, gpus_per_replica: int, topology: dict,
                per_node: dict[str, int] | None = None, domains: dict[str, str] | None = None) -> tuple[str, str] | None:
    """Why a gang could not be placed on the cluster as it is now even were the cluster empty, or None.

    Returns (the spec field to lower, a sentence naming the largest that fits). The submit check
    refuses with it; the scheduler cycle gives it as the reason of a queued job the cluster shrank
    under (nodes removed or cordoned, a re-partitioning). ``per_node``: the flavor's units per
    schedulable node, when the caller has them; ``domains``: for a required nvlink or rack
    topology, each of those nodes' NVLink domain or rack (read when not given; a node in none
    holds no replica of such a gang, as placement has it).
    """
    per_node = flavor_units_per_node(flavor) if per_node is None else per_node
    nodes = f"{len(per_node)} node{'' if len(per_node) == 1 else 's'} with {flavor.name} left"
    largest = max(per_node.values(), default=0)
    if not per_node:
        return "gpus_per_replica", f"No schedulable node has {flavor.name} now."
    if gpus_per_replica > largest:
        return "gpus_per_replica", (
            f"Each replica needs {units_text(flavor, gpus_per_replica)} on one node, and the largest node now has "
            f"{largest} ({nodes}); the most one replica can have is {largest}."
        )
    level = topology["level"] if topology["mode"] == "required" else "none"
    if level == "node":
        fits = max(units // gpus_per_replica for units in per_node.values())
    elif level in DOMAIN_FIELDS:
        if domains is None:
            domains = dict(Node.objects.filter(name__in=list(per_node)).values_list("name", DOMAIN_FIELDS[level]))
        by_domain: dict[str, int] = {}
        for name, units in per_node.items():
            if domains.get(name):
                by_domain[domains[name]] = by_domain.get(domains[name], 0) + units // gpus_per_replica
        fits = max(by_domain.values(), default=0)
    else:
        fits, level = sum(units // gpus_per_replica for units in per_node.values()), "none"
    where = _DOMAIN_WORDS.get(level, "in the cluster")
    if replicas > fits:
        return "replicas", (
            f"It needs {replicas} replicas of {units_text(flavor, gpus_per_replica)} {where}, and at most {fits} fit "
            f"{where} as it is now ({nodes})."
        )
    return None


def gang_fits_the_cluster(flavor: ResourceFlavor, *, replicas: int, gpus_per_replica: int, topology: dict) -> None:
    """Refuse a gang that could never be placed on the cluster as it is now, naming the largest that fits."""
    misfit = gang_misfit(flavor, replicas=replicas, gpus_per_replica=gpus_per_replica, topology=topology)
    if misfit is not None:
        raise Invalid(*misfit)


def _request_hash(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()


def _idempotency_key(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= 255 or not value.isascii() or not value.isprintable():
        raise Invalid("Idempotency-Key", "1 to 255 printable ASCII characters.")
    return value


def job_submit(*, actor: AbstractBaseUser, data) -> Job:
    """Check and queue a job; the scheduler cycle is kicked after commit."""
    return job_submit_keyed(actor=actor, data=data, idempotency_key=None)[0]


def job_submit_keyed(*, actor: AbstractBaseUser, data, idempotency_key: str | None) -> tuple[Job, bool]:
    """Check and queue a job; the scheduler cycle is kicked after commit. Returns (job, created).

    With an idempotency key, the same key and body within IDEMPOTENCY_KEY_TTL_S answer the job
    the first request made (created False), never a second job; the same key with another body
    is refused. The environment's and tenant's rows are locked while the job is written, so a
    delete of the environment and the per-tenant cap on queued jobs both hold under concurrency.
    """
    key = _idempotency_key(idempotency_key)
    checked = job_spec_check(actor=actor, data=data)
    spec = checked["spec"]
    digest = _request_hash(spec)
    cutoff = timezone.now() - timezone.timedelta(seconds=settings.IDEMPOTENCY_KEY_TTL_S)
    try:
        with transaction.atomic():
            if key is not None:
                IdempotencyKey.objects.filter(user=actor, key=key, created_at__lt=cutoff).delete()
                earlier = IdempotencyKey.objects.filter(user=actor, key=key).select_related("job").first()
                if earlier is not None:
                    if earlier.request_hash != digest:
                        raise Invalid("Idempotency-Key", "This key was used for a different job; use a new key.")
                    return earlier.job, False
            environment = queue_locks(checked["tenant"], checked["environment"])
            if environment is None or environment.state != EnvironmentState.READY:
                raise Invalid("environment", f"Environment {checked['environment'].name} is no longer ready.")
            bundle = checked["bundle"]
            if bundle is not None:
                # Held until the job is written: a delete of the bundle takes the same row lock before it
                # asks which jobs use it, so it either sees this job or this submit sees no bundle.
                bundle = bundle_check(checked["tenant"], spec["bundle"], for_update=True)
            job = job_queue_locked(
                tenant=checked["tenant"], environment=environment, flavor=checked["flavor"], spec=spec,
                submitted_by=actor, actor=actor, event_reason=f"Submitted by {actor.get_username()}.",
                bundle=bundle,
            )
            datasets.uses_record(tenant=checked["tenant"], job_id=job.id, job_name=job.name,
                                 versions=checked["datasets"])
            if key is not None:
                IdempotencyKey.objects.create(user=actor, key=key, request_hash=digest, job=job)
    except IntegrityError:
        # The same key, submitted at the same moment by another request: that one made the job.
        earlier = IdempotencyKey.objects.filter(user=actor, key=key).select_related("job").first() if key else None
        if earlier is None:
            raise
        if earlier.request_hash != digest:
            raise Invalid("Idempotency-Key", "This key was used for a different job; use a new key.") from None
        return earlier.job, False
    return job, True


def queue_locks(tenant: Tenant, environment: Environment) -> Environment | None:
    """Lock the tenant's row, then the environment's (the order environment_delete takes them), each
    alone, before a job is queued in it; returns the environment read fresh (None if it is gone)."""
    Tenant.objects.select_for_update().filter(id=tenant.id).order_by("id").first()
    return Environment.objects.select_for_update(of=("self",)).filter(id=environment.id).order_by("id").first()


def queued_retry_after_s() -> int:
    """When a submit refused past JOB_QUEUED_MAX_PER_TENANT may try again: the next cycle, in whole seconds."""
    return max(1, math.ceil(settings.SCHEDULER_CYCLE_INTERVAL_S))


def job_queue_locked(*, tenant: Tenant, environment: Environment, flavor: ResourceFlavor, spec: dict, submitted_by,
                     actor, event_reason: str, kind: str = Job.Kind.TRAINING, bundle=None) -> Job:
    """Queue a checked job, the caller holding `queue_locks`: the tenant's budget of waiting jobs, the
    row, its first event and its audit entry; the cycle is kicked after commit. Every job is queued
    here, a training job or an endpoint's replica. TooMany past JOB_QUEUED_MAX_PER_TENANT (its
    ``retry_after_s`` says when to try again)."""
    waiting = Job.objects.filter(tenant=tenant, state=JobState.QUEUED).count()
    if waiting >= settings.JOB_QUEUED_MAX_PER_TENANT:
        refused = TooMany(f"Tenant {tenant.slug} already has {waiting} jobs waiting "
                          f"(JOB_QUEUED_MAX_PER_TENANT is {settings.JOB_QUEUED_MAX_PER_TENANT}); "
                          f"submit more once some have started.")
        refused.retry_after_s = queued_retry_after_s()
        raise refused
    job = Job.objects.create(
        tenant=tenant, environment=environment, name=spec["name"], kind=kind, spec=spec, flavor=flavor,
        replicas=spec["replicas"], gpus_per_replica=spec["gpus_per_replica"], priority=spec["priority"],
        preemptible=spec["preemptible"], submitted_by=submitted_by, reason=NOT_YET_SEEN_REASON, bundle=bundle,
    )
    JobEvent.objects.create(job=job, to_state=JobState.QUEUED, reason=event_reason[:1000])
    record("job.submitted", actor=actor, tenant=tenant, obj=job, object_repr=f"{job.name} #{job.id}",
           after={"state": job.state, "kind": job.kind, "flavor": flavor.name, "replicas": job.replicas,
                  "gpus_per_replica": job.gpus_per_replica, "priority": job.priority,
                  "preemptible": job.preemptible, "environment": environment.name,
                  **({"template": "script", "bundle": bundle.sha256, "command": spec["command"]} if bundle else {})})
    transaction.on_commit(kick_cycle)
    return job


def job_preemptible_set(job_id: int, value: bool) -> bool:
    """Make a job preemptible or not (an endpoint's replica moving into or out of its tenant's guarantee),
    under the job's row lock; the caller has checked the guarantee. Only a job that waits or runs
    changes: one being stopped (preempted, cancelling) or over is left as it is. True if the job
    now is as asked."""
    job = Job.objects.select_for_update(of=("self",)).filter(id=job_id).first()
    if job is None:
        return False
    if job.preemptible == value:
        return True
    if job.state not in (JobState.QUEUED, JobState.ADMITTED, JobState.LAUNCHING, JobState.RUNNING):
        return False
    spec = {**job.spec, "preemptible": value}
    Job.objects.filter(id=job.id).update(preemptible=value, spec=spec)
    return True


def job_cancel(*, actor: AbstractBaseUser, job: Job) -> Job:
    """Cancel a job: at once while it waits; with the grace period once it launched or runs.

    No cluster call happens here: the stop goes to a worker after commit (job_stop), and the
    reconcile asks again, and kills past the deadline, whatever happens to that message.
    """
    require_role(user=actor, tenant=job.tenant, at_least=Role.MEMBER)
    with transaction.atomic():
        job = Job.objects.select_for_update(of=("self",)).get(id=job.id)
        before = job.state
        job_cancel_locked(job, f"Cancelled by {actor.get_username()}.")
        if job.state != before:
            record_job_cancelled(job, actor=actor, before=before)
        if job.state == JobState.CANCELLING:
            transaction.on_commit(lambda: send_job_stop(job.id))
        transaction.on_commit(kick_cycle)
    return job


def record_job_cancelled(job: Job, *, actor, before: str, why: str = "") -> None:
    """The audit entry of a cancel (the caller's transaction holds the job's row)."""
    after = {"state": job.state, "reason": why} if why else {"state": job.state}
    record("job.cancelled", actor=actor, tenant=job.tenant, obj=job, object_repr=f"{job.name} #{job.id}",
           before={"state": before}, after=after)


def job_cancel_locked(job: Job, reason: str, *, final_is_conflict: bool = True) -> None:
    """Cancel a job whose row the caller holds locked; the caller sends the stop after commit if it is cancelling."""
    if job.state in JOB_FINAL_STATES:
        if final_is_conflict:
            raise Conflict(f"Job {job.name} has already {job.state}.")
        return
    if job.state == JobState.CANCELLING:
        return
    if job.state in (JobState.QUEUED, JobState.ADMITTED):
        # Admitted means no launch is in flight (a launch claims under this row lock): end the attempt here.
        if job.attempts.open().update(
            outcome="cancelled", ended_at=timezone.now(), reason=reason[:1000], launch_lease_until=None
        ):
            signals.ended(job.id)
        transition(job, JobState.CANCELLED, reason)
    else:
        deadline = timezone.now() + timezone.timedelta(seconds=settings.PREEMPTION_GRACE_PERIOD_S)
        transition(job, JobState.CANCELLING, reason, stop_deadline=deadline)


def jobs_cancel_in_environment(environment: Environment, reason: str, *, actor=None) -> None:
    """Cancel every job of an environment being deleted, inside the delete's transaction (the
    tenant's and the environment's rows are locked, so no job slips in after the cancels). Jobs
    that wait end cancelled at once; jobs that run are told to stop after commit."""
    for job in Job.objects.select_for_update(of=("self",)).filter(environment=environment).exclude(
        state__in=JOB_FINAL_STATES
    ).order_by("id"):
        before = job.state
        job_cancel_locked(job, reason, final_is_conflict=False)
        if job.state != before:
            record_job_cancelled(job, actor=actor, before=before, why=reason)
        if job.state == JobState.CANCELLING:
            transaction.on_commit(lambda job_id=job.id: send_job_stop(job_id))


def jobs_using_bundle(bundle) -> list[Job]:
    """The jobs not over yet that run this bundle: deleting it is refused while there are any. Call it holding
    the bundle's row lock (select_for_update), as a submit does, so no job slips in between."""
    return list(Job.objects.filter(bundle=bundle).exclude(state__in=JOB_FINAL_STATES).order_by("id"))
