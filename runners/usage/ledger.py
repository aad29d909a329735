"""The usage ledger: attempts' allocations and checkpoints' keeping, cut per day and per price, priced.

An attempt holds its GPU units from its admission (the cycle reserved them) until it ended, or
until now while it runs (with no end recorded but a later attempt admitted: until that admission);
its start is clipped to the end of the job's previous attempts, so a preemption and its resume
never count the same second twice, and an attempt is always counted beside the other attempts of
its job (one's end, recorded late, moves the others'). A piece is one day (UTC) and one
price card of one attempt: units x seconds, priced at the card in force, and at the flavor's
cloud reference price beside it.

Storage is charged per GB-month (30 days), for what the store holds of the tenant's:

- a checkpoint in the checkpoint store: its ``stored_bytes`` (the chunks it added that no durable checkpoint
  of the tenant named: its bytes after deduplication) from when it became durable until retention discarded
  it, and each of its handovers (item ``handover:<id>``: the bytes of chunks a discarded checkpoint was
  charged for that it still names) from the discard until it is discarded too. So at every moment the
  tenant is charged the bytes of the distinct chunks its durable checkpoints name, each once, across its
  jobs (the store deduplicates per tenant), and nothing for chunks no durable checkpoint names. A handover is
  an item of its own, so one recorded after its checkpoint's days were written is still counted whole by the
  next sweep, with no correction to the checkpoint's entries. A checkpoint the store never took (its
  backend's files unreadable to the portal, written before the store, or refused by the quota) is charged
  its file's bytes from its writing to the file's deletion, as it is kept on the environment's volume; one
  still pending or storing is charged nothing until it is durable or failed;
- a code bundle (its stored archive, item ``bundle:<id>``, a tenant's with no job) from its upload to its
  deletion;
- a sealed dataset version (item ``dataset:<version id>``): the bytes of the shards it added that no
  version of the same tenant sealed before it held, from its seal on (sealed versions are kept). Each shard
  is charged once per tenant that owns a dataset holding it, to that tenant; a tenant a dataset is shared
  with pays nothing for it, and two tenants that stored the same shard each pay for it, so no tenant's
  bill depends on, or tells, what another tenant stores.

The sweep (``settle_run``) writes what has ended, and every whole day of what still runs, as
entries; an entry is never edited: when the truth of an item changes (an attempt found to have
ended later, a checkpoint's deletion learnt late), the difference is a new correction entry. A
query adds, for items the sweep has not reached, their truth up to now less what is written.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal

from django.conf import settings
from django.db import connection, transaction
from django.db.models import (
    BigIntegerField,
    Case,
    DateTimeField,
    Exists,
    F,
    Min,
    OuterRef,
    Q,
    Subquery,
    Sum,
    Value,
    When,
)
from django.db.models.functions import Extract, Greatest
from django.utils import timezone

from quotas.models import PriceCard, ResourceFlavor
from runners.bundles.models import Bundle
from runners.datasets.models import DatasetVersion, VersionState
from runners.inference.models import Replica
from runners.jobs.models import Checkpoint, CheckpointHandover, JobAttempt
from runners.usage.models import CapacityChange, CloudPrice, EntryKind, Settlement, UsageEntry

SECONDS_PER_HOUR = Decimal(3600)
SECONDS_PER_MONTH = Decimal(30 * 86400)  # a GB-month is one GB kept for 30 days
BYTES_PER_GB = Decimal(10**9)
CENT = Decimal("0.01")
SETTLE_BATCH = 500


def _seconds(start: datetime, end: datetime) -> Decimal:
    return Decimal((end - start) // timedelta(microseconds=1)) / Decimal(10**6)


def _q(value: Decimal, places: str) -> Decimal:
    return value.quantize(Decimal(places), rounding=ROUND_HALF_EVEN)


def midnight(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


def utc_day(moment: datetime) -> date:
    return moment.astimezone(UTC).date()


def days_of(start: datetime, end: datetime) -> list[tuple[date, datetime, datetime]]:
    """[start, end) cut at UTC midnights: (day, from, to) each."""
    pieces = []
    while start < end:
        day = utc_day(start)
        cut = min(end, midnight(day + timedelta(days=1)))
        pieces.append((day, start, cut))
        start = cut
    return pieces


@dataclass(frozen=True)
class Card:
    id: int | None
    effective_from: datetime
    price_per_hour: Decimal
    currency: str


class Prices:
    """Every flavor's price cards and cloud reference prices, to cut an interval where a price changes."""

    def __init__(self) -> None:
        self.cards: dict[int, list[Card]] = defaultdict(list)
        self.cloud: dict[int, list[Card]] = defaultdict(list)
        for card in PriceCard.objects.order_by("flavor_id", "effective_from"):
            self.cards[card.flavor_id].append(Card(card.id, card.effective_from, card.price_per_hour, card.currency))
        for card in CloudPrice.objects.order_by("flavor_id", "effective_from"):
            self.cloud[card.flavor_id].append(Card(card.id, card.effective_from, card.price_per_hour, card.currency))

    @staticmethod
    def _at(cards: list[Card], moment: datetime) -> Card | None:
        index = bisect.bisect_right([card.effective_from for card in cards], moment) - 1
        return cards[index] if index >= 0 else None

    def card_at(self, flavor_id: int, moment: datetime) -> Card | None:
        return self._at(self.cards.get(flavor_id, []), moment)

    def cloud_at(self, flavor_id: int, moment: datetime) -> Card | None:
        return self._at(self.cloud.get(flavor_id, []), moment)

    def segments(self, flavor_id: int, start: datetime, end: datetime) -> list[tuple[datetime, datetime, Card | None]]:
        """[start, end) cut per day and wherever a price card starts: (from, to, card in force) each."""
        changes = [card.effective_from for card in self.cards.get(flavor_id, []) if start < card.effective_from < end]
        out = []
        for _day, day_start, day_end in days_of(start, end):
            bounds = [day_start, *[moment for moment in changes if day_start < moment < day_end], day_end]
            out += [(a, b, self.card_at(flavor_id, a)) for a, b in zip(bounds, bounds[1:])]
        return out


@dataclass(frozen=True)
class Piece:
    """What one item cost in one day and at one price (the unit entries are written in)."""

    item: str
    piece: str
    kind: str
    tenant_id: int
    flavor_id: int | None
    job_id: int | None
    endpoint_id: int | None
    day: date
    gpu_seconds: Decimal
    gb_seconds: Decimal
    price_card_id: int | None
    cost: Decimal
    cloud_cost: Decimal | None
    currency: str


def _currency() -> str:
    return settings.USAGE_CURRENCY


# --- What each item is, in truth ------------------------------------------------------------


@dataclass(frozen=True)
class AttemptRow:
    id: int
    job_id: int
    tenant_id: int
    flavor_id: int
    units: int
    endpoint_id: int | None
    start: datetime  # admitted, clipped to the previous attempt's end
    end: datetime | None  # None while open (no end and no later attempt); never before start
    ended_at: datetime | None  # as the attempt records it
    alone: bool = True  # the job's only attempt (else an earlier or later one can move its start or end)


def attempt_rows(attempts: list[JobAttempt]) -> list[AttemptRow]:
    """The attempts as the ledger counts them (their job, flavor and endpoint read once)."""
    job_ids = {attempt.job_id for attempt in attempts}
    siblings: dict[int, list[tuple[int, datetime, datetime | None]]] = defaultdict(list)
    for row in JobAttempt.objects.filter(job_id__in=job_ids).values("job_id", "number", "admitted_at", "ended_at"):
        siblings[row["job_id"]].append((row["number"], row["admitted_at"], row["ended_at"]))
    endpoints = dict(Replica.objects.filter(job_id__in=job_ids).values_list("job_id", "endpoint_id"))
    rows = []
    for attempt in attempts:
        job = attempt.job
        start = attempt.admitted_at
        ends_before = [ended for number, _, ended in siblings[job.id] if number < attempt.number]
        latest_before = max((end for end in ends_before if end is not None), default=None)
        if latest_before is not None and latest_before > start:
            start = latest_before
        end = attempt.ended_at
        if end is None:
            # No end recorded, yet a later attempt was admitted: this one held its units until then.
            end = min((admitted for number, admitted, _ in siblings[job.id] if number > attempt.number), default=None)
        end = end if end is None or end > start else start
        rows.append(AttemptRow(attempt.id, job.id, job.tenant_id, job.flavor_id, job.units,
                               endpoints.get(job.id), start, end, attempt.ended_at, len(siblings[job.id]) == 1))
    return rows


def attempt_pieces(row: AttemptRow, upto: datetime, prices: Prices) -> list[Piece]:
    end = min(row.end, upto) if row.end is not None else upto
    pieces = []
    for start, stop, card in prices.segments(row.flavor_id, row.start, end) if row.start < end else []:
        gpu_seconds = _seconds(start, stop) * row.units
        cloud = prices.cloud_at(row.flavor_id, start)
        if cloud is not None and cloud.currency != (card.currency if card else _currency()):
            cloud = None  # a reference in another currency is not summed beside the cost
        pieces.append(Piece(
            item=f"attempt:{row.id}", piece=f"{utc_day(start).isoformat()}/{card.id if card else '-'}",
            kind=EntryKind.GPU, tenant_id=row.tenant_id, flavor_id=row.flavor_id, job_id=row.job_id,
            endpoint_id=row.endpoint_id, day=utc_day(start), gpu_seconds=gpu_seconds, gb_seconds=Decimal(0),
            price_card_id=card.id if card else None,
            cost=gpu_seconds * card.price_per_hour / SECONDS_PER_HOUR if card else Decimal(0),
            cloud_cost=gpu_seconds * cloud.price_per_hour / SECONDS_PER_HOUR if cloud else None,
            currency=card.currency if card else _currency(),
        ))
    return _merged(pieces)


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Pieces of the same day and price (an interval cut at a card that did not change the price) as one."""
    by_key: dict[str, Piece] = {}
    for piece in pieces:
        seen = by_key.get(piece.piece)
        if seen is None:
            by_key[piece.piece] = piece
        else:
            by_key[piece.piece] = Piece(**{
                **seen.__dict__, "gpu_seconds": seen.gpu_seconds + piece.gpu_seconds,
                "gb_seconds": seen.gb_seconds + piece.gb_seconds, "cost": seen.cost + piece.cost,
                "cloud_cost": None if seen.cloud_cost is None and piece.cloud_cost is None
                else (seen.cloud_cost or 0) + (piece.cloud_cost or 0),
            })
    return list(by_key.values())


def _kept_pieces(item: str, size: int, created_at: datetime | None, deleted_at: datetime | None, tenant_id: int,
                 job_id: int | None, upto: datetime, since: datetime | None) -> list[Piece]:
    """Storage kept from its writing to its deletion (or `upto`), per day, at the storage price (nothing when
    it is not charged yet: `created_at` None)."""
    if created_at is None:
        return []
    end = min(deleted_at, upto) if deleted_at else upto
    begin = max(created_at, since) if since else created_at
    price = Decimal(settings.USAGE_STORAGE_PRICE_PER_GB_MONTH)
    pieces = []
    for day, start, stop in days_of(begin, end) if begin < end else []:
        gb_seconds = Decimal(size) / BYTES_PER_GB * _seconds(start, stop)
        pieces.append(Piece(
            item=item, piece=day.isoformat(), kind=EntryKind.STORAGE,
            tenant_id=tenant_id, flavor_id=None, job_id=job_id, endpoint_id=None,
            day=day, gpu_seconds=Decimal(0), gb_seconds=gb_seconds, price_card_id=None,
            cost=gb_seconds * price / SECONDS_PER_MONTH, cloud_cost=None, currency=_currency(),
        ))
    return pieces


# A checkpoint the store never took (not asked, refused, or skipped as superseded while the agent was behind)
# is kept as its file, on the environment's volume, and charged as that file.
NOT_IN_STORE = ("", "failed", "skipped")


def checkpoint_charge(checkpoint: Checkpoint) -> tuple[int, datetime | None, datetime | None]:
    """What a checkpoint is charged for: (bytes, from, until), `from` None while it is not charged yet."""
    if checkpoint.durable_at is not None:
        return checkpoint.stored_bytes, checkpoint.durable_at, checkpoint.discarded_at
    if checkpoint.store_state in NOT_IN_STORE:
        return checkpoint.bytes, checkpoint.created_at, checkpoint.deleted_at
    return 0, None, None


def _charged(model):
    """The annotations every storage row is found by: charged_bytes, charged_from, charged_until (the SQL
    form of checkpoint_charge, and its like for bundles and dataset versions)."""
    if model is Checkpoint:
        return {
            "charged_bytes": Case(When(durable_at__isnull=False, then=F("stored_bytes")),
                                  When(store_state__in=NOT_IN_STORE, then=F("bytes")),
                                  default=Value(0), output_field=BigIntegerField()),
            "charged_from": Case(When(durable_at__isnull=False, then=F("durable_at")),
                                 When(store_state__in=NOT_IN_STORE, then=F("created_at")),
                                 default=Value(None), output_field=DateTimeField()),
            "charged_until": Case(When(durable_at__isnull=False, then=F("discarded_at")),
                                  default=F("deleted_at"), output_field=DateTimeField()),
        }
    if model is CheckpointHandover:  # charged from the discard that handed it over until its checkpoint's own
        return {"charged_bytes": F("bytes"), "charged_from": F("handed_at"),
                "charged_until": F("checkpoint__discarded_at")}
    if model is Bundle:
        return {"charged_from": F("created_at"), "charged_until": F("deleted_at")}
    return {"charged_from": Case(When(state=VersionState.SEALED, then=F("sealed_at")), default=Value(None),
                                 output_field=DateTimeField()),
            "charged_until": Value(None, output_field=DateTimeField())}


def checkpoint_pieces(checkpoint: Checkpoint, upto: datetime, *, since: datetime | None = None) -> list[Piece]:
    size, start, end = checkpoint_charge(checkpoint)
    return _kept_pieces(f"checkpoint:{checkpoint.id}", size, start, end, checkpoint.job.tenant_id, checkpoint.job_id,
                        upto, since)


def handover_pieces(handover: CheckpointHandover, upto: datetime, *, since: datetime | None = None) -> list[Piece]:
    """Bytes handed over to a kept checkpoint at a discard, charged to it (its job) until it is discarded."""
    checkpoint = handover.checkpoint
    return _kept_pieces(f"handover:{handover.id}", handover.bytes, handover.handed_at, checkpoint.discarded_at,
                        checkpoint.job.tenant_id, checkpoint.job_id, upto, since)


def bundle_pieces(bundle: Bundle, upto: datetime, *, since: datetime | None = None) -> list[Piece]:
    """A code bundle's stored archive, charged like a checkpoint: the tenant's, no job's."""
    return _kept_pieces(f"bundle:{bundle.id}", bundle.size_bytes, bundle.created_at, bundle.deleted_at,
                        bundle.tenant_id, None, upto, since)


def dataset_stored_bytes(version_ids) -> dict[int, int]:
    """Per sealed dataset version, the bytes of the shards it added to its tenant's store: those no version of
    the tenant sealed before it (by seal time, then id) held. Sealed versions never change and are kept, so
    the figure of a version never moves."""
    version_ids = list(version_ids)
    if not version_ids:
        return {}
    with connection.cursor() as cursor:
        cursor.execute("""
            SELECT first_version, SUM(bytes) FROM (
                SELECT DISTINCT ON (dataset.tenant_id, shard.sha256) shard.version_id AS first_version, shard.bytes
                FROM datasets_versionshard shard
                JOIN datasets_datasetversion version ON version.id = shard.version_id
                JOIN datasets_dataset dataset ON dataset.id = version.dataset_id
                WHERE version.state = 'sealed' AND dataset.tenant_id IN (
                    SELECT owner.tenant_id FROM datasets_datasetversion asked
                    JOIN datasets_dataset owner ON owner.id = asked.dataset_id WHERE asked.id = ANY(%s))
                ORDER BY dataset.tenant_id, shard.sha256, version.sealed_at, version.id
            ) firsts WHERE first_version = ANY(%s) GROUP BY first_version
        """, [version_ids, version_ids])
        return {version_id: int(size) for version_id, size in cursor.fetchall()}


def dataset_pieces(version: DatasetVersion, upto: datetime, *, since: datetime | None = None,
                   stored: dict[int, int] | None = None) -> list[Piece]:
    """A sealed dataset version's shards that no earlier version of its tenant held, charged from its seal."""
    size = (stored if stored is not None else dataset_stored_bytes([version.id])).get(version.id, 0)
    start = version.sealed_at if version.state == VersionState.SEALED else None
    return _kept_pieces(f"dataset:{version.id}", size, start, None, version.dataset.tenant_id, None, upto, since)


def _storage_span(kind: str, obj) -> tuple[datetime | None, datetime | None]:
    """When a storage item's charge starts and ends (None: not yet; still kept)."""
    if kind == "checkpoint":
        return checkpoint_charge(obj)[1:]
    if kind == "handover":
        return obj.handed_at, obj.checkpoint.discarded_at
    if kind == "bundle":
        return obj.created_at, obj.deleted_at
    return (obj.sealed_at if obj.state == VersionState.SEALED else None), None


# --- Writing it -------------------------------------------------------------------------------


def _written(items: list[str]) -> dict[tuple[str, str], dict]:
    """What the ledger holds of these items, per piece (with what a piece's reversal names: one query)."""
    rows = (
        UsageEntry.objects.filter(item__in=items).values("item", "piece")
        .annotate(gpu=Sum("gpu_seconds"), gb=Sum("gb_seconds"), cost=Sum("cost"), cloud=Sum("cloud_cost"),
                  kind=Min("kind"), tenant_id=Min("tenant_id"), flavor_id=Min("flavor_id"), job_id=Min("job_id"),
                  endpoint_id=Min("endpoint_id"), day=Min("day"), price_card_id=Min("price_card_id"),
                  currency=Min("currency"))
        .order_by()
    )
    return {(row["item"], row["piece"]): row for row in rows}


def differences(truth: list[Piece], written: dict[tuple[str, str], dict], items: list[str]) -> list[Piece]:
    """The pieces that bring what is written to the truth (a negative one where too much was)."""
    wanted = {(piece.item, piece.piece): piece for piece in truth}
    out = []
    for key, piece in wanted.items():
        seen = written.get(key)
        gpu = _q(piece.gpu_seconds, "0.001") - (seen["gpu"] if seen else 0)
        gb = _q(piece.gb_seconds, "0.001") - (seen["gb"] if seen else 0)
        cost = _q(piece.cost, "0.000001") - (seen["cost"] if seen else 0)
        written_cloud = (seen or {}).get("cloud")
        cloud = (None if piece.cloud_cost is None and not written_cloud
                 else _q(piece.cloud_cost or Decimal(0), "0.000001") - (written_cloud or 0))
        if gpu or gb or cost or cloud:
            out.append(Piece(**{**piece.__dict__, "gpu_seconds": gpu, "gb_seconds": gb, "cost": cost,
                                "cloud_cost": cloud}))
    for (item, piece_key), seen in written.items():
        if item in items and (item, piece_key) not in wanted and (seen["gpu"] or seen["gb"] or seen["cost"]):
            out.append(_reversal(item, piece_key, seen))
    return out


def _reversal(item: str, piece_key: str, seen: dict) -> Piece:
    """A piece that no longer belongs to an item's truth (its interval shrank), taken back."""
    return Piece(
        item=item, piece=piece_key, kind=seen["kind"], tenant_id=seen["tenant_id"], flavor_id=seen["flavor_id"],
        job_id=seen["job_id"], endpoint_id=seen["endpoint_id"], day=seen["day"], gpu_seconds=-seen["gpu"],
        gb_seconds=-seen["gb"], price_card_id=seen["price_card_id"], cost=-seen["cost"],
        cloud_cost=-seen["cloud"] if seen["cloud"] is not None else None, currency=seen["currency"],
    )


@dataclass(frozen=True)
class _Work:
    """One item to bring up to date: its truth to compare with what is written, or only its new days."""

    item: str
    pieces: list[Piece]
    tail_only: bool  # pieces lie after everything written of the item (an open item's new days)
    upto: datetime
    closed: bool


@dataclass(frozen=True)
class _Seen:
    upto: datetime
    closed: bool


def _plan(attempts: list[JobAttempt], checkpoints: list[Checkpoint], through: datetime, prices: Prices, *,
          fresh: bool = True, bundles: list[Bundle] = (), datasets: list[DatasetVersion] = (),
          handovers: list[CheckpointHandover] = ()) -> list[_Work]:
    """What to write for these items, counting open ones through `through`.

    `fresh`: read the items' settlements now (a writer, under the items' locks); otherwise use what
    the query that found them read alongside (a reader).
    """
    if fresh:
        rows = Settlement.objects.filter(
            Q(kind="attempt", object_id__in=[a.id for a in attempts])
            | Q(kind="checkpoint", object_id__in=[c.id for c in checkpoints])
            | Q(kind="bundle", object_id__in=[b.id for b in bundles])
            | Q(kind="dataset", object_id__in=[v.id for v in datasets])
            | Q(kind="handover", object_id__in=[h.id for h in handovers])
        )
        settled = {f"{row.kind}:{row.object_id}": _Seen(row.upto, row.closed) for row in rows}
    else:
        settled = {
            f"{prefix}{obj.id}": _Seen(obj.settled_upto, obj.settled_closed)
            for prefix, objs in (("attempt:", attempts), ("checkpoint:", checkpoints), ("bundle:", bundles),
                                 ("dataset:", datasets), ("handover:", handovers))
            for obj in objs if obj.settled_upto is not None
        }
    work = []
    for row in attempt_rows(attempts):
        item, seen = f"attempt:{row.id}", settled.get(f"attempt:{row.id}")
        # Only new days to add, when nothing else can have changed: an open attempt alone in its job
        # (a sibling's end recorded late moves this one's start) counted up to a midnight.
        if row.end is None and row.alone and seen is not None and not seen.closed:
            tail = replace(row, start=max(row.start, seen.upto))
            work.append(_Work(item, attempt_pieces(tail, through, prices), True, through, False))
        else:
            # An ended attempt is counted to its end (today included); an open one through `through`.
            counted_to = row.ended_at or row.end or through
            work.append(_Work(item, attempt_pieces(row, row.end or through, prices), False, counted_to,
                              row.end is not None))
    stored = dataset_stored_bytes([version.id for version in datasets])
    pieces_by_kind = {"checkpoint": checkpoint_pieces, "handover": handover_pieces, "bundle": bundle_pieces,
                      "dataset": lambda version, upto, since=None: dataset_pieces(version, upto, since=since,
                                                                                  stored=stored)}
    for kind, kept in (("checkpoint", checkpoints), ("handover", handovers), ("bundle", bundles),
                       ("dataset", datasets)):
        pieces_of = pieces_by_kind[kind]
        for obj in kept:
            start, end = _storage_span(kind, obj)
            if start is None:
                continue  # not charged yet (a checkpoint being stored): no settlement, so it is found again
            item, seen = f"{kind}:{obj.id}", settled.get(f"{kind}:{obj.id}")
            if end is None and seen is not None and not seen.closed:
                work.append(_Work(item, pieces_of(obj, through, since=seen.upto), True, through, False))
            else:
                work.append(_Work(item, pieces_of(obj, end or through), False, end or through, end is not None))
    return work


def _changes(work: list[_Work]) -> list[Piece]:
    """The pieces to append so each item's entries sum to its truth."""
    compared = [entry.item for entry in work if not entry.tail_only]
    written = _written(compared) if compared else {}
    truth = [piece for entry in work if not entry.tail_only for piece in entry.pieces]
    tails = [piece for entry in work if entry.tail_only for piece in entry.pieces]
    return tails + differences(truth, written, compared)


# The lock a flavor's repricing takes alone and each batch that counts its attempts takes shared (the
# two-key advisory locks, a space apart from the items' one-key locks): "usage" in ASCII, and the flavor.
FLAVOR_LOCK_CLASS = 0x75736167


def _lock_flavors(flavor_ids, *, shared: bool) -> None:
    if not flavor_ids:
        return
    function = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {function}(%s, flavor) FROM (SELECT unnest(%s::int[]) AS flavor ORDER BY 1) AS flavors",
            [FLAVOR_LOCK_CLASS, sorted(flavor_ids)],
        )


def _write(attempt_ids: list[int], checkpoint_ids: list[int], through: datetime, bundle_ids: list[int] = (),
           dataset_ids: list[int] = (), handover_ids: list[int] = ()) -> int:
    """Settle a batch of items (with the other attempts of their jobs) in one transaction, each item
    locked so two sweeps never add the same piece.

    Everything the plan depends on is read under the locks: the items themselves (one found open
    may have ended and been settled since), their settlements and the prices (a card added for the
    past forgets its flavor's settlements under the flavor's lock, which waits for this batch).
    """
    if attempt_ids:
        # Every attempt of their jobs: one's end (recorded late, or none) moves where the others start and end.
        jobs = JobAttempt.objects.filter(id__in=attempt_ids).values("job_id")
        attempt_ids = sorted(set(attempt_ids) | set(JobAttempt.objects.filter(job_id__in=jobs)
                                                     .values_list("id", flat=True)))
    items = sorted([f"attempt:{i}" for i in attempt_ids] + [f"checkpoint:{i}" for i in checkpoint_ids]
                   + [f"bundle:{i}" for i in bundle_ids] + [f"dataset:{i}" for i in dataset_ids]
                   + [f"handover:{i}" for i in handover_ids])
    if not items:
        return 0
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_advisory_xact_lock(hashtext('usage:' || item)) FROM (SELECT unnest(%s::text[]) AS item "
                "ORDER BY 1) AS items", [items],
            )
        attempts = list(JobAttempt.objects.select_related("job").filter(id__in=attempt_ids).order_by("id"))
        checkpoints = list(Checkpoint.objects.select_related("job").filter(id__in=checkpoint_ids).order_by("id"))
        bundles = list(Bundle.objects.filter(id__in=bundle_ids).order_by("id"))
        datasets = list(DatasetVersion.objects.select_related("dataset").filter(id__in=dataset_ids).order_by("id"))
        handovers = list(CheckpointHandover.objects.select_related("checkpoint__job").filter(id__in=handover_ids)
                         .order_by("id"))
        _lock_flavors({attempt.job.flavor_id for attempt in attempts}, shared=True)
        work = _plan(attempts, checkpoints, through, Prices(), bundles=bundles, datasets=datasets,
                     handovers=handovers)
        written_before = set(_written([entry.item for entry in work]))
        changes = _changes(work)
        UsageEntry.objects.bulk_create([
            UsageEntry(
                kind=piece.kind, item=piece.item, piece=piece.piece, tenant_id=piece.tenant_id,
                flavor_id=piece.flavor_id, job_id=piece.job_id, endpoint_id=piece.endpoint_id, day=piece.day,
                gpu_seconds=_q(piece.gpu_seconds, "0.001"), gb_seconds=_q(piece.gb_seconds, "0.001"),
                price_card_id=piece.price_card_id, cost=_q(piece.cost, "0.000001"),
                cloud_cost=_q(piece.cloud_cost, "0.000001") if piece.cloud_cost is not None else None,
                currency=piece.currency, correction=(piece.item, piece.piece) in written_before or piece.cost < 0,
            )
            for piece in changes
        ], batch_size=2000)
        Settlement.objects.bulk_create(
            [Settlement(kind=entry.item.split(":")[0], object_id=int(entry.item.split(":")[1]), upto=entry.upto,
                        closed=entry.closed) for entry in work],
            update_conflicts=True, unique_fields=["kind", "object_id"], update_fields=["upto", "closed", "settled_at"],
        )
    return len(changes)


def _stale_query(model, end_field: str, start_field: str, through: datetime, tenant_ids=None,
                 counted_since: datetime | None = None, job_ids=None):
    """Rows whose ledger is behind: ended since last counted, or open with time before `through` uncounted.

    `counted_since`: leave out open rows already counted from that moment on (the caller sums them itself).
    An open row settled closed (an attempt with no end whose job went on to a later attempt) is counted.
    """
    fields = {JobAttempt: ["number", "admitted_at", "ended_at", "job__tenant_id", "job__flavor_id", "job__replicas",
                           "job__gpus_per_replica"],
              Checkpoint: ["bytes", "created_at", "deleted_at", "stored_bytes", "store_state", "durable_at",
                           "discarded_at", "job__tenant_id"],
              Bundle: ["size_bytes", "created_at", "deleted_at", "tenant_id"],
              DatasetVersion: ["state", "sealed_at", "dataset__tenant_id"],
              CheckpointHandover: ["bytes", "handed_at", "checkpoint__discarded_at", "checkpoint__job__tenant_id"],
              }[model]
    if model is CheckpointHandover:  # its checkpoint's job's
        rows = model.objects.select_related("checkpoint__job").only("id", "checkpoint_id", *fields)
        tenant_field = "checkpoint__job__tenant_id"
    elif model is Bundle:  # a tenant's own, no job's
        rows, tenant_field = model.objects.only("id", *fields), "tenant_id"
    elif model is DatasetVersion:  # its dataset's tenant's, no job's
        rows, tenant_field = model.objects.select_related("dataset").only("id", *fields), "dataset__tenant_id"
    else:
        rows, tenant_field = model.objects.select_related("job").only("id", "job_id", *fields), "job__tenant_id"
    if model is not JobAttempt:
        rows = rows.annotate(**_charged(model))
    kind = {JobAttempt: "attempt", Checkpoint: "checkpoint", Bundle: "bundle", DatasetVersion: "dataset",
            CheckpointHandover: "handover"}[model]
    settlement = Settlement.objects.filter(kind=kind, object_id=OuterRef("id"))
    rows = rows.annotate(settled_upto=Subquery(settlement.values("upto")[:1]),
                         settled_closed=Subquery(settlement.values("closed")[:1]))
    if tenant_ids is not None:
        rows = rows.filter(**{f"{tenant_field}__in": tenant_ids})
    if job_ids is not None:
        rows = (rows.none() if model in (Bundle, DatasetVersion)
                else rows.filter(checkpoint__job_id__in=job_ids) if model is CheckpointHandover
                else rows.filter(job_id__in=job_ids))
    counted_to_end = settlement.filter(closed=True, upto=OuterRef(end_field))
    counted_through = settlement.filter(
        Q(closed=True) | Q(upto__gte=min(through, counted_since or through))
    )
    # A storage item not charged yet (a checkpoint being stored, a version not sealed) is left alone.
    ended = Q(**{f"{end_field}__isnull": False, f"{start_field}__isnull": False}) & ~Exists(counted_to_end)
    running = Q(**{f"{end_field}__isnull": True, f"{start_field}__lt": through}) & ~Exists(counted_through)
    return rows, ended, running


def _stale(model, end_field: str, start_field: str, through: datetime, tenant_ids=None,
           counted_since: datetime | None = None, job_ids=None) -> list:
    rows, ended, running = _stale_query(model, end_field, start_field, through, tenant_ids, counted_since, job_ids)
    stale = [*rows.filter(ended).order_by("id"), *rows.filter(running).order_by("id")]
    if model is JobAttempt and stale:
        # The other attempts of their jobs too: one's end moves where the others start and end.
        stale += rows.filter(job_id__in={row.job_id for row in stale}).exclude(id__in=[row.id for row in stale])
    return stale


def _stale_attempts(through: datetime, tenant_ids=None, job_ids=None) -> list[JobAttempt]:
    return _stale(JobAttempt, "ended_at", "admitted_at", through, tenant_ids, job_ids=job_ids)


def _stale_checkpoints(through: datetime, tenant_ids=None, counted_since: datetime | None = None,
                       job_ids=None) -> list[Checkpoint]:
    return _stale(Checkpoint, "charged_until", "charged_from", through, tenant_ids, counted_since, job_ids)


def _kept_checkpoints_today(now: datetime, tenant_ids=None, job_ids=None) -> list[Piece]:
    """Today's storage of the checkpoints still kept and counted through today's midnight (their own bytes and
    their handovers'), summed per job in SQL.

    These are most checkpoints of a cluster (every job keeps its newest few for as long as it
    exists), and their day so far is one interval each, so the database sums it.
    """
    today = midnight(utc_day(now))
    byte_seconds: dict[tuple[int, int], Decimal] = defaultdict(Decimal)
    for model, kind, job in ((Checkpoint, "checkpoint", "job"), (CheckpointHandover, "handover", "checkpoint__job")):
        rows = (
            model.objects.annotate(**_charged(model))
            .filter(charged_until__isnull=True, charged_from__isnull=False)
            .filter(Exists(Settlement.objects.filter(kind=kind, object_id=OuterRef("id"), closed=False,
                                                     upto__gte=today)))
            .values(f"{job}_id", f"{job}__tenant_id")
            .annotate(byte_seconds=Sum(F("charged_bytes")
                                       * Extract(Value(now) - Greatest("charged_from", Value(today)), "epoch")))
            .order_by()
        )
        if tenant_ids is not None:
            rows = rows.filter(**{f"{job}__tenant_id__in": tenant_ids})
        if job_ids is not None:
            rows = rows.filter(**{f"{job}_id__in": job_ids})
        for row in rows:
            byte_seconds[row[f"{job}_id"], row[f"{job}__tenant_id"]] += Decimal(row["byte_seconds"] or 0)
    price = Decimal(settings.USAGE_STORAGE_PRICE_PER_GB_MONTH)
    pieces = []
    for (job_id, tenant_id), total in sorted(byte_seconds.items()):
        gb_seconds = total / BYTES_PER_GB
        pieces.append(Piece(
            item=f"kept-checkpoints-of-job:{job_id}", piece=today.date().isoformat(), kind=EntryKind.STORAGE,
            tenant_id=tenant_id, flavor_id=None, job_id=job_id, endpoint_id=None, day=today.date(),
            gpu_seconds=Decimal(0), gb_seconds=gb_seconds, price_card_id=None,
            cost=gb_seconds * price / SECONDS_PER_MONTH, cloud_cost=None, currency=_currency(),
        ))
    return pieces


def reprice_from(flavor_id: int, moment: datetime) -> int:
    """A price or cloud reference of a flavor changed from `moment` on: have the sweep count its attempts since again.

    Their settlements are forgotten, so the next sweep compares each one's whole truth with what is
    written and appends the differences as corrections; returns how many. Done under the flavor's
    lock, held to the end of the caller's transaction (the new price's): a batch counting the
    flavor's attempts with the old prices commits first and its settlements are forgotten here; one
    that starts after reads the new price.
    """
    with transaction.atomic():
        _lock_flavors({flavor_id}, shared=False)
        touched = JobAttempt.objects.filter(job__flavor_id=flavor_id).exclude(ended_at__lte=moment).values("id")
        return Settlement.objects.filter(kind="attempt", object_id__in=touched).delete()[0]


def _capacity_history_started(now: datetime) -> None:
    """A flavor with no capacity history yet starts one at its capacity now (the idle line counts from there)."""
    known = set(CapacityChange.objects.values_list("flavor_id", flat=True).distinct())
    CapacityChange.objects.bulk_create([
        CapacityChange(flavor_id=flavor_id, capacity=capacity, at=now)
        for flavor_id, capacity in ResourceFlavor.objects.values_list("id", "capacity") if flavor_id not in known
    ])


def settle_run(now: datetime | None = None, *, batch: int = SETTLE_BATCH, budget_s: float | None = None) -> dict:
    """Write what has ended and every whole day of what runs; returns how many items and entries.

    The stale items are read a batch at a time. After `budget_s` (USAGE_SETTLE_BUDGET_S) the sweep
    stops at the end of a batch and says `more`: the next one goes on, so a sweep ends well within
    the broker's visibility timeout and is never handed to a second worker while it runs.
    """
    now = now or timezone.now()
    through = midnight(utc_day(now))
    budget_s = settings.USAGE_SETTLE_BUDGET_S if budget_s is None else budget_s
    started = time.monotonic()
    _capacity_history_started(now)
    items = entries = 0
    for model, end_field, start_field in ((JobAttempt, "ended_at", "admitted_at"),
                                          (Checkpoint, "charged_until", "charged_from"),
                                          (CheckpointHandover, "charged_until", "charged_from"),
                                          (Bundle, "charged_until", "charged_from"),
                                          (DatasetVersion, "charged_until", "charged_from")):
        after = 0
        while True:
            rows, ended, running = _stale_query(model, end_field, start_field, through)
            ids = list(rows.filter(ended | running, id__gt=after).order_by("id").values_list("id", flat=True)[:batch])
            if not ids:
                break
            if model is JobAttempt:
                entries += _write(ids, [], through)
            elif model is Checkpoint:
                entries += _write([], ids, through)
            elif model is CheckpointHandover:
                entries += _write([], [], through, handover_ids=ids)
            elif model is Bundle:
                entries += _write([], [], through, ids)
            else:
                entries += _write([], [], through, dataset_ids=ids)
            items, after = items + len(ids), ids[-1]
            if time.monotonic() - started >= budget_s:
                return {"items": items, "entries": entries, "more": True}
    return {"items": items, "entries": entries, "more": False}


def settle_jobs(job_ids: list[int], now: datetime | None = None) -> int:
    """Settle the ended attempts of these jobs now (an attempt just ended); returns entries written."""
    through = midnight(utc_day(now or timezone.now()))
    ids = list(JobAttempt.objects.filter(job_id__in=job_ids, ended_at__isnull=False).values_list("id", flat=True))
    return _write(ids, [], through)


def unwritten(now: datetime, *, tenant_ids: set[int] | None = None, job_ids: list[int] | None = None) -> list[Piece]:
    """What the ledger does not hold yet, up to now: open items since they were counted, and stale ones
    (of these tenants or jobs only, when given)."""
    after_today = midnight(utc_day(now)) + timedelta(days=1)  # everything up to now counts, today included
    attempts = _stale_attempts(after_today, tenant_ids, job_ids)
    checkpoints = _stale_checkpoints(after_today, tenant_ids, counted_since=midnight(utc_day(now)), job_ids=job_ids)
    handovers = _stale(CheckpointHandover, "charged_until", "charged_from", after_today, tenant_ids,
                       counted_since=midnight(utc_day(now)), job_ids=job_ids)
    # Kept bundles are few beside checkpoints: each is planned (today's tail from the last midnight counted).
    bundles = _stale(Bundle, "charged_until", "charged_from", after_today, tenant_ids, job_ids=job_ids)
    datasets = _stale(DatasetVersion, "charged_until", "charged_from", after_today, tenant_ids, job_ids=job_ids)
    return (_changes(_plan(attempts, checkpoints, now, Prices(), fresh=False, bundles=bundles, datasets=datasets,
                           handovers=handovers))
            + _kept_checkpoints_today(now, tenant_ids, job_ids))
