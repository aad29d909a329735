"""Writing the audit log: one entry per change, inside the transaction that makes the change.

A service calls ``record`` after it has written its change and before its transaction commits,
so a change that fails (and rolls back) leaves no entry, and a committed change always has one.
``before`` and ``after`` hold only the fields that matter for the change, as JSON-safe values.
"""

import datetime
import uuid
from decimal import Decimal

import structlog
from django.db import models, transaction

from audit.chain import HASHED_FIELDS, chain_moved, chain_next, entry_hash
from audit.models import AuditChainHead, AuditEntry

# The names written for work the portal does by itself.
SYSTEM = "system"
SCHEDULER = "scheduler"

REPR_MAX = AuditEntry._meta.get_field("object_repr").max_length


def _json_safe(value):
    """A value as JSON can hold it: decimals and UUIDs as strings, moments as ISO 8601, models as their key."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, models.Model):
        return value.pk
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_json_safe(item) for item in value]
    return str(value)


def snapshot(obj: models.Model, fields: list[str]) -> dict:
    """The named fields of an object, JSON-safe (a foreign key as its id: write `flavor_id`, or name
    a property of your own choosing)."""
    return {field: _json_safe(getattr(obj, field)) for field in fields}


def _request_id() -> str:
    """The id of the request (or task) being served, when the request-id middleware bound one for logging."""
    try:
        value = structlog.contextvars.get_contextvars().get("request_id")
    except Exception:  # noqa: BLE001 - the log must never fail a change for want of a request id
        return ""
    return str(value)[:100] if value else ""


def _actor(actor) -> tuple[object | None, str]:
    """(the user, the name to write): a user, or a string naming the portal's own worker."""
    if actor is None:
        return None, SYSTEM
    if isinstance(actor, str):
        return None, actor[:150]
    if not getattr(actor, "is_authenticated", False):
        return None, "anonymous"
    return actor, actor.get_username()[:150]


def record(
    action: str,
    *,
    actor,
    tenant=None,
    obj: models.Model | None = None,
    object_type: str = "",
    object_id=None,
    object_repr: str = "",
    before: dict | None = None,
    after: dict | None = None,
) -> AuditEntry:
    """Add one entry to the audit log, in the caller's transaction, chained to the entry before it.

    ``actor`` is the user who made the change, or a string for the portal's own work
    (SCHEDULER, SYSTEM). ``obj`` names what changed (its type, id and text); give
    ``object_type``/``object_id``/``object_repr`` instead for an object that is gone.
    """
    user, actor_name = _actor(actor)
    if obj is not None:
        object_type = object_type or obj._meta.model_name
        object_id = obj.pk if object_id is None else object_id
        object_repr = object_repr or str(obj)
    entry = AuditEntry(
        actor=user,
        actor_name=actor_name,
        tenant_id=tenant.pk if tenant is not None else None,
        tenant_slug=tenant.slug if tenant is not None else "",
        action=action,
        object_type=object_type,
        object_id="" if object_id is None else str(object_id),
        object_repr=object_repr[:REPR_MAX],
        before=_json_safe(before),
        after=_json_safe(after),
        request_id=_request_id(),
    )
    # No savepoint: an insert that fails must fail the change with it. The append lock is held until the
    # change's transaction ends, so the next entry chains to this one.
    with transaction.atomic(savepoint=False):
        entry.id, entry.prev_hash = chain_next(AuditEntry._meta.db_table, AuditChainHead._meta.db_table)
        entry.hash = entry_hash({field: getattr(entry, field) for field in HASHED_FIELDS})
        entry.save()
        chain_moved(AuditChainHead._meta.db_table, entry.hash)
    return entry
