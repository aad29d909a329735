"""The audit log's hash chain: each entry carries the hash of the entry before it (prev_hash) and its own
(hash: SHA-256 of its contents and prev_hash), so a missing, changed or forged entry breaks the chain,
and `manage.py audit_verify` says where.

Entries are appended one at a time: `chain_next` locks the chain's head (one row holding the last
entry's hash) until the appending transaction ends, so two transactions appending at once chain one
after the other, and takes the entry's id under that lock, so the chain runs in id order. The head is
read and locked by a write, not a read: an audited change costs no extra read per entry.
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


def chain_next(table: str, head_table: str) -> tuple[int, str]:
    """(the next entry's id, the last entry's hash), the head locked until the transaction ends (be in one).
    A missing head (an emptied test database) starts from the last entry there is."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {head_table} (id, hash) "  # noqa: S608 - our own table names
            f"SELECT 1, coalesce((SELECT hash FROM {table} ORDER BY id DESC LIMIT 1), '') "
            f"ON CONFLICT (id) DO UPDATE SET hash = {head_table}.hash "
            "RETURNING hash, nextval(pg_get_serial_sequence(%s, 'id'))",
            [table],
        )
        previous, entry_id = cursor.fetchone()
        return entry_id, previous


def chain_moved(head_table: str, entry_hash_: str) -> None:
    """The head names the entry just appended (same transaction as its insert)."""
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {head_table} SET hash = %s WHERE id = 1", [entry_hash_])  # noqa: S608


def chain_problems(rows, head: str = "") -> list[str]:
    """What is wrong with the chain, read in id order (each row a dict of HASHED_FIELDS and hash); `head`,
    the head's hash read before the rows, must be among them (else entries were removed from the end)."""
    problems, previous, head_seen = [], None, not head
    for row in rows:
        head_seen = head_seen or row["hash"] == head
        expected_prev = previous["hash"] if previous else ""
        if row["prev_hash"] != expected_prev:
            after = f"entry {previous['id']}" if previous else "the start of the log"
            problems.append(f"entry {row['id']} does not follow {after}: a gap (an entry missing) or an entry "
                            "added out of turn")
        if entry_hash(row) != row["hash"]:
            problems.append(f"entry {row['id']} does not match its contents: changed, or forged")
        previous = row
    if not head_seen:
        last = f"entry {previous['id']}" if previous else "no entry"
        problems.append(f"the log ends at {last} but its head names an entry after it: entries removed from its end")
    return problems
