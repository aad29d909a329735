"""The audit log's hash chain: each entry carries the hash of the entry before it (prev_hash) and its own
(hash: SHA-256 of its contents and prev_hash), so a missing, changed or forged entry breaks the chain,
and `manage.py audit_verify` says where.

Entries are appended one at a time: `chain_next` takes a transaction-level advisory lock, held until the
appending transaction ends, so two transactions appending at once chain one after the other. The ids are
taken under the lock too, so the chain runs in id order.
"""

import hashlib
import json
from datetime import timezone

from django.db import connection

# The advisory lock key serializing appends (any bigint no other lock of the portal uses).
CHAIN_LOCK = 0x61756469745F6C67
# What an entry's hash covers, besides prev_hash.
HASHED_FIELDS = ["id", "at", "actor_id", "actor_name", "tenant_id", "tenant_slug", "action", "object_type",
                 "object_id", "object_repr", "before", "after", "request_id", "prev_hash"]


def _canonical(value):
    """JSON values as PostgreSQL's jsonb gives them back: a float with no fraction is an integer there."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _canonical(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_canonical(item) for item in value]
    return value


def entry_hash(values: dict) -> str:
    """The hash of an entry's fields (a dict of HASHED_FIELDS, `at` an aware datetime)."""
    data = {field: _canonical(values[field]) for field in HASHED_FIELDS}
    data["at"] = values["at"].astimezone(timezone.utc).isoformat()
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def chain_next(table: str) -> tuple[int, str]:
    """(the next entry's id, the last entry's hash), under the append lock; in a transaction, which holds it."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [CHAIN_LOCK])
        cursor.execute(f"SELECT hash FROM {table} ORDER BY id DESC LIMIT 1")  # noqa: S608 - our own table name
        row = cursor.fetchone()
        cursor.execute("SELECT nextval(pg_get_serial_sequence(%s, 'id'))", [table])
        return cursor.fetchone()[0], row[0] if row else ""


def chain_problems(rows) -> list[str]:
    """What is wrong with the chain, read in id order (each row a dict of HASHED_FIELDS and hash)."""
    problems, previous = [], None
    for row in rows:
        expected_prev = previous["hash"] if previous else ""
        if row["prev_hash"] != expected_prev:
            after = f"entry {previous['id']}" if previous else "the start of the log"
            problems.append(f"entry {row['id']} does not follow {after}: a gap (an entry missing) or an entry "
                            "added out of turn")
        if entry_hash(row) != row["hash"]:
            problems.append(f"entry {row['id']} does not match its contents: changed, or forged")
        previous = row
    return problems
