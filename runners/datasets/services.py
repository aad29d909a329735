"""Datasets: create, share, push a version shard by shard (resumable, each shard checked), seal, register from a URL.

What holds, whatever fails midway:

- a shard is stored only once its bytes hash to its name: parts are kept under ``uploads/`` of the store
  until the last one arrives, then joined, hashed, and put into the blob store (kind "shards") only when
  the hash matches; a mismatch is refused (400) and its parts removed, so nothing of it is stored or served;
- a push resumes where it stopped: each shard's parts are named by their offset and length, a part cut short
  is not counted, and the server says how many bytes of each shard it has;
- a version is readable only once sealed, and sealed only when every shard it declared is stored; once
  sealed nothing in it changes (its shards and index are fixed; a push makes a new version);
- the same bytes are stored once, but a tenant counts a shard as held (and need not send it) only when a
  version it may read already holds it: knowing a hash is not having the bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import tempfile
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import Max
from django.db.models.functions import Coalesce
from django.utils import timezone
from gpuportal import datasets as packing

from audit.services import record
from common.dispatch import send_task
from common.errors import Conflict, Invalid, NotAllowed, NotFound
from runners.datasets import selectors
from runners.datasets.models import (
    NAME_PATTERN,
    Dataset,
    DatasetShare,
    DatasetUse,
    DatasetVersion,
    VersionShard,
    VersionState,
)
from runners.storage.blobs import SHA256, BlobStore, HashMismatch
from tenants.models import Role, Tenant
from tenants.services import require_role

logger = logging.getLogger(__name__)

SHARDS = "shards"
UPLOADS = "uploads"
# The largest shard a version may hold, and the most shards: a push packs within the first.
SHARD_MAX_BYTES_DEFAULT = 256 * 1024 * 1024
MAX_SHARDS_DEFAULT = 100_000
# How many shards one request declares at most (the JSON body stays within API_MAX_BODY_BYTES).
DECLARE_BATCH_MAX = 2000
PART_BYTES_DEFAULT = 8 * 1024 * 1024


def shard_max_bytes() -> int:
    return int(getattr(settings, "DATASET_SHARD_MAX_BYTES", SHARD_MAX_BYTES_DEFAULT))


def max_shards() -> int:
    return int(getattr(settings, "DATASET_MAX_SHARDS", MAX_SHARDS_DEFAULT))


def part_bytes() -> int:
    """How many bytes one upload request carries at most: DATASET_UPLOAD_PART_BYTES, and within the request body
    bound unless the shard upload's path is one whose view bounds its body itself (REQUEST_BODY_BOUNDED_BY_VIEW)."""
    wanted = int(getattr(settings, "DATASET_UPLOAD_PART_BYTES", PART_BYTES_DEFAULT))
    sample = "/api/v1/tenants/t/datasets/d/versions/1/shards/" + "0" * 64 + "/"
    exempt = any(re.match(pattern, sample) for pattern in getattr(settings, "REQUEST_BODY_BOUNDED_BY_VIEW", []))
    return wanted if exempt else min(wanted, settings.REQUEST_MAX_BODY_BYTES)


def store(kind: str = SHARDS) -> BlobStore:
    return BlobStore(settings.DATA_STORAGE_URL, kind, settings.DATA_STORAGE_OPTIONS)


# --- Datasets and shares --------------------------------------------------------------------------------


def dataset_create(*, actor: AbstractBaseUser, tenant: Tenant, name, description="") -> Dataset:
    """A new, empty dataset of the tenant (members); Invalid naming ``name`` for a bad or taken name."""
    require_role(user=actor, tenant=tenant, at_least=Role.MEMBER)
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        raise Invalid("name", "Lowercase letters, digits and '-', at most 63, starting and ending alphanumeric.")
    if not isinstance(description, str) or len(description) > 500:
        raise Invalid("description", "At most 500 characters.")
    try:
        with transaction.atomic():
            dataset = Dataset.objects.create(tenant=tenant, name=name, description=description,
                                             created_by=actor if actor.is_authenticated else None)
            record("dataset.created", actor=actor, tenant=tenant, obj=dataset, object_repr=name, after={"name": name})
    except IntegrityError:
        raise Invalid("name", f"Tenant {tenant.slug} already has a dataset {name}.") from None
    return dataset


def _own(actor: AbstractBaseUser, tenant: Tenant, dataset: Dataset, at_least: str = Role.MEMBER) -> None:
    """Writes are for the owning tenant's members: a tenant it is shared with reads only."""
    if dataset.tenant_id != tenant.id:
        raise NotAllowed(f"{selectors.reference_of(dataset, tenant)} is shared with {tenant.slug} read-only; "
                         f"only {dataset.tenant.slug} changes it.")
    require_role(user=actor, tenant=tenant, at_least=at_least)


def dataset_share(*, actor: AbstractBaseUser, tenant: Tenant, dataset: Dataset, with_slug) -> DatasetShare:
    """Share the dataset read-only with another tenant (admins of the owner). The other tenant is named by slug;
    sharing twice answers the share there is."""
    _own(actor, tenant, dataset, Role.ADMIN)
    other = Tenant.objects.filter(slug=with_slug).first() if isinstance(with_slug, str) else None
    if other is None:
        raise Invalid("tenant", f"No tenant {with_slug!r}.")
    if other.id == tenant.id:
        raise Invalid("tenant", "A dataset is its own tenant's already.")
    with transaction.atomic():
        share, created = DatasetShare.objects.get_or_create(
            dataset=dataset, tenant=other, defaults={"created_by": actor if actor.is_authenticated else None})
        if created:
            record("dataset.shared", actor=actor, tenant=tenant, obj=dataset, object_repr=dataset.name,
                   after={"with": other.slug})
    return share


def dataset_unshare(*, actor: AbstractBaseUser, tenant: Tenant, dataset: Dataset, with_slug) -> None:
    """Stop sharing (admins of the owner). Jobs already queued keep the versions they pinned until they read them."""
    _own(actor, tenant, dataset, Role.ADMIN)
    with transaction.atomic():
        deleted, _ = DatasetShare.objects.filter(dataset=dataset, tenant__slug=with_slug).delete()
        if not deleted:
            raise NotFound(f"{dataset.name} is not shared with {with_slug}.")
        record("dataset.unshared", actor=actor, tenant=tenant, obj=dataset, object_repr=dataset.name,
               before={"with": with_slug})


# --- Pushing a version ----------------------------------------------------------------------------------


def _lock_dataset(dataset: Dataset) -> Dataset:
    return Dataset.objects.select_for_update().get(id=dataset.id)


def version_open(*, actor: AbstractBaseUser, tenant: Tenant, dataset: Dataset, manifest_sha256,
                 source: str = "upload") -> tuple[DatasetVersion, bool]:
    """An open version to push into: the open one of this manifest when a push of it was cut (created False),
    else a new one numbered after every other."""
    _own(actor, tenant, dataset)
    if not isinstance(manifest_sha256, str) or not SHA256.match(manifest_sha256):
        raise Invalid("manifest_sha256", "The digest of the shard list (gpuportal.datasets.manifest_sha256): 64 hex digits.")
    with transaction.atomic():
        _lock_dataset(dataset)
        if source == "upload":
            existing = dataset.versions.filter(state=VersionState.OPEN, manifest_sha256=manifest_sha256,
                                               source="upload").first()
            if existing is not None:
                _touch(existing)
                return existing, False
        number = (dataset.versions.aggregate(top=Max("number"))["top"] or 0) + 1
        version = DatasetVersion.objects.create(dataset=dataset, number=number, manifest_sha256=manifest_sha256,
                                                source=source, created_by=actor if actor.is_authenticated else None,
                                                touched_at=timezone.now(),
                                                register_sends=0 if source == "upload" else 1)
    return version, True


def _touch(version: DatasetVersion) -> None:
    """A sign of life of an open version (see DatasetVersion.touched_at): the sweep leaves it a lease from now."""
    DatasetVersion.objects.filter(id=version.id, state=VersionState.OPEN).update(touched_at=timezone.now())


def _open_version_locked(version: DatasetVersion) -> DatasetVersion:
    row = DatasetVersion.objects.select_for_update().get(id=version.id)
    if row.state != VersionState.OPEN:
        raise Conflict(f"Version {row.number} of {version.dataset.name} is {row.state}: a sealed version never changes; "
                       "push again to make a new one.")
    return row


def _shard_fields(item, position_max: int) -> tuple[int, str, int, int]:
    if not isinstance(item, dict):
        raise Invalid("shards", 'Each shard is {"position", "sha256", "bytes", "samples"}.')
    position, sha256, size, samples = item.get("position"), item.get("sha256"), item.get("bytes"), item.get("samples", 0)
    for field, value, low, high in (("position", position, 0, position_max), ("bytes", size, 1, shard_max_bytes()),
                                    ("samples", samples, 0, 2**31 - 1)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise Invalid("shards", f"{field} {value!r}: a whole number from {low} to {high}.")
    if not isinstance(sha256, str) or not SHA256.match(sha256):
        raise Invalid("shards", f"sha256 {sha256!r}: 64 lowercase hex digits.")
    return position, sha256, size, samples


def shards_declare(*, actor: AbstractBaseUser, tenant: Tenant, version: DatasetVersion, shards) -> list[dict]:
    """Declare shards of an open version (positions and hashes; again is fine, with the same hashes). Answers the
    version's shards not stored yet, with the bytes received of each: what the push still sends."""
    _own(actor, tenant, version.dataset)
    if not isinstance(shards, list) or len(shards) > DECLARE_BATCH_MAX:
        raise Invalid("shards", f"A list of at most {DECLARE_BATCH_MAX} shards per request.")
    parsed = [_shard_fields(item, max_shards() - 1) for item in shards]
    with transaction.atomic():
        _open_version_locked(version)
        existing = {row.position: row for row in version.shard_rows.filter(position__in=[p[0] for p in parsed])}
        held = {row.sha256: row for row in selectors.held_shards(tenant).filter(sha256__in=[p[1] for p in parsed])}
        blobs = store()
        new = []
        for position, sha256, size, samples in parsed:
            row = existing.get(position)
            if row is not None:
                if (row.sha256, row.bytes) != (sha256, size):
                    raise Invalid("shards", f"Shard {position} was declared as {row.sha256} ({row.bytes} bytes); a "
                                            "version's shards do not change: push again to start a new version.")
                continue
            known = held.get(sha256)
            stored = known is not None and known.bytes == size and blobs.exists(sha256)
            new.append(VersionShard(version=version, position=position, sha256=sha256, bytes=size, samples=samples,
                                    stored=stored, members=known.members if stored else []))
        VersionShard.objects.bulk_create(new)
        _touch(version)
    return missing(version)


def missing(version: DatasetVersion) -> list[dict]:
    """The version's declared shards not stored yet: [{"position", "sha256", "bytes", "received_bytes"}]."""
    rows = list(version.shard_rows.filter(stored=False).order_by("position"))
    received = {}
    for row in rows:
        if row.sha256 not in received:
            received[row.sha256] = _received(version, row.sha256, row.bytes)[0]
    return [{"position": row.position, "sha256": row.sha256, "bytes": row.bytes, "received_bytes": received[row.sha256]}
            for row in rows]


def _parts_folder(version: DatasetVersion, sha256: str) -> tuple[BlobStore, str]:
    uploads = store(UPLOADS)
    return uploads, f"{uploads.root}/{version.id}/{sha256}"


def _received(version: DatasetVersion, sha256: str, total: int) -> tuple[int, list[str]]:
    """(bytes received from 0 on, their parts' paths in order). A part is named <offset>-<length>; one whose size
    is not its length (cut while written) and everything after a gap are not counted."""
    uploads, folder = _parts_folder(version, sha256)
    uploads.fs.invalidate_cache(folder)
    try:
        listed = uploads.fs.ls(folder, detail=True)
    except FileNotFoundError:
        return 0, []
    parts = {}
    for entry in listed:
        name = entry["name"].rsplit("/", 1)[-1]
        match = re.fullmatch(r"(\d{15})-(\d+)", name)
        if match and int(entry.get("size") or 0) == int(match.group(2)):
            parts[int(match.group(1))] = (int(match.group(2)), entry["name"])
    offset, paths = 0, []
    while offset in parts and offset < total:
        length, path = parts[offset]
        if length == 0:
            break
        paths.append(path)
        offset += length
    return offset, paths


def _remove_parts(version: DatasetVersion, sha256: str) -> None:
    uploads, folder = _parts_folder(version, sha256)
    with contextlib.suppress(FileNotFoundError):
        uploads.fs.rm(folder, recursive=True)
    uploads.fs.invalidate_cache(folder)


def _remove_version_parts(version: DatasetVersion) -> None:
    """Remove every upload part of the version (its folder under uploads/)."""
    uploads = store(UPLOADS)
    folder = f"{uploads.root}/{version.id}"
    with contextlib.suppress(FileNotFoundError):
        uploads.fs.rm(folder, recursive=True)
    uploads.fs.invalidate_cache(folder)


def shard_receive(*, actor: AbstractBaseUser, tenant: Tenant, version: DatasetVersion, sha256: str, offset, stream,
                  length: int) -> dict:
    """Take one part of a declared shard's bytes, at `offset` (what the server has of it: a push that resumes asks
    first). The last part joins them, checks the hash and stores the shard; a mismatch is Invalid (400) and
    removes the parts, so nothing of the bad bytes is kept. Answers {"sha256", "received_bytes", "stored"}."""
    _own(actor, tenant, version.dataset)
    version = DatasetVersion.objects.get(id=version.id)
    if version.state != VersionState.OPEN:
        raise Conflict(f"Version {version.number} is {version.state}: a sealed version never changes.")
    row = version.shard_rows.filter(sha256=sha256).first()
    if row is None:
        raise NotFound(f"Version {version.number} declares no shard {sha256}.")
    if row.stored:
        return {"sha256": sha256, "received_bytes": row.bytes, "stored": True}
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise Invalid("offset", "A whole number of bytes from 0.")
    if not 0 < length <= part_bytes():
        raise Invalid("body", f"A part holds 1 to {part_bytes()} bytes.")
    have, _paths = _received(version, sha256, row.bytes)
    if offset != have:
        raise Conflict(f"The portal has {have} bytes of shard {sha256}; send the part at offset {have}.")
    if offset + length > row.bytes:
        raise Invalid("body", f"Shard {sha256} is {row.bytes} bytes; this part goes past its end.")
    uploads, folder = _parts_folder(version, sha256)
    with tempfile.NamedTemporaryFile(prefix="dataset-part-") as spool:
        copied = 0
        for block in iter(lambda: stream.read(min(1 << 20, length - copied)) if copied < length else b"", b""):
            spool.write(block)
            copied += len(block)
        spool.flush()
        if copied != length:
            raise Invalid("body", f"The part's body held {copied} bytes, not the {length} its Content-Length said.")
        uploads.fs.makedirs(folder, exist_ok=True)
        # A part cut while written is ignored (its size is not its name's); the push sends it again.
        uploads.fs.put_file(spool.name, f"{folder}/{offset:015d}-{length}")
    _touch(version)
    have = offset + length
    if have < row.bytes:
        return {"sha256": sha256, "received_bytes": have, "stored": False}
    _store_received(version, row)
    return {"sha256": sha256, "received_bytes": row.bytes, "stored": True}


def _store_received(version: DatasetVersion, row: VersionShard) -> None:
    """Join a shard's parts, check its hash, put it in the blob store and mark the version's rows of it stored."""
    _have, paths = _received(version, row.sha256, row.bytes)
    uploads, _folder = _parts_folder(version, row.sha256)
    with tempfile.TemporaryDirectory(prefix="dataset-shard-") as work:
        joined = Path(work) / "shard.tar"
        digest = hashlib.sha256()
        with open(joined, "wb") as target:
            for path in paths:
                with uploads.fs.open(path, "rb") as part:
                    for block in iter(lambda: part.read(1 << 20), b""):
                        digest.update(block)
                        target.write(block)
        if digest.hexdigest() != row.sha256:
            _remove_parts(version, row.sha256)
            raise Invalid("sha256", f"The bytes received for shard {row.sha256} hash to {digest.hexdigest()}; they are "
                                    "not stored. Pack the folder again and push.")
        try:
            with open(joined, "rb") as handle:
                members = packing.shard_index(handle)
        except Exception:  # noqa: BLE001 - any unreadable tar is the client's mistake, said in one line
            _remove_parts(version, row.sha256)
            raise Invalid("sha256", f"Shard {row.sha256} is not a tar file (WebDataset shards are tars).") from None
        store().put_file_hashed(joined, row.sha256)  # hashed as it was joined, above
    VersionShard.objects.filter(version=version, sha256=row.sha256).update(stored=True, members=members)
    _remove_parts(version, row.sha256)


def version_seal(*, actor: AbstractBaseUser, tenant: Tenant, version: DatasetVersion, shards) -> DatasetVersion:
    """Seal an open version once every shard it declared (positions 0 to shards-1) is stored; Conflict naming what
    is missing otherwise. Sealing a sealed version with the same count answers it."""
    _own(actor, tenant, version.dataset)
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= max_shards():
        raise Invalid("shards", f"How many shards the version holds: 1 to {max_shards()}.")
    with transaction.atomic():
        row = DatasetVersion.objects.select_for_update().get(id=version.id)
        if row.state == VersionState.SEALED and row.shards == shards:
            return row
        row = _open_version_locked(row)
        rows = list(row.shard_rows.order_by("position").values_list("position", "stored", "bytes", "samples",
                                                                    "members"))
        if [position for position, *_ in rows] != list(range(shards)):
            raise Conflict(f"Version {row.number} declares {len(rows)} shards, not positions 0 to {shards - 1}; "
                           "declare every shard before sealing.")
        unstored = [position for position, stored, *_ in rows if not stored]
        if unstored:
            raise Conflict(f"Version {row.number} still lacks {len(unstored)} shards (first: {unstored[0]}); upload "
                           "them, then seal.")
        _seal_locked(row, rows, actor)
    return row


def _seal_locked(row: DatasetVersion, rows, actor) -> None:
    row.state = VersionState.SEALED
    row.sealed_at = timezone.now()
    row.shards = len(rows)
    row.bytes = sum(size for _p, _s, size, _n, _m in rows)
    row.samples = sum(samples for _p, _s, _b, samples, _m in rows)
    row.files = sum(len(members or []) for *_rest, members in rows)
    row.save(update_fields=["state", "sealed_at", "shards", "bytes", "samples", "files"])
    record("dataset.version_sealed", actor=actor, tenant=row.dataset.tenant, obj=row.dataset,
           object_repr=f"{row.dataset.name}:{row.number}",
           after={"version": row.number, "shards": row.shards, "bytes": row.bytes, "files": row.files,
                  "source": row.source})


def version_discard(*, actor: AbstractBaseUser, tenant: Tenant, version: DatasetVersion) -> None:
    """Drop an open or failed version and its parts (a sealed one is kept: jobs may have read it)."""
    _own(actor, tenant, version.dataset)
    with transaction.atomic():
        row = DatasetVersion.objects.select_for_update().get(id=version.id)
        if row.state == VersionState.SEALED:
            raise Conflict(f"Version {row.number} is sealed; sealed versions are kept.")
        row.delete()
    _remove_version_parts(version)


# --- Registering from a storage URL ---------------------------------------------------------------------


def source_prefixes(tenant: Tenant) -> list[str]:
    """The storage URLs a tenant may register datasets from (DATASET_SOURCE_URLS, ``{tenant}`` its slug). Only
    these: the portal's own credentials read them, so a tenant must never name the store or another's folder."""
    default = [f"file://{Path(settings.VAR_DIR) / 'datasets-incoming'}/{{tenant}}/"]
    return [prefix.format(tenant=tenant.slug) for prefix in getattr(settings, "DATASET_SOURCE_URLS", default)]


def version_register(*, actor: AbstractBaseUser, tenant: Tenant, dataset: Dataset, url) -> DatasetVersion:
    """A new version packed from a storage URL (a folder or s3://bucket/prefix) by a worker; it is sealed when
    packed, or failed with the reason."""
    _own(actor, tenant, dataset)
    if not isinstance(url, str) or "\x00" in url or ".." in url.split("/"):
        raise Invalid("url", "A storage URL (s3://bucket/prefix/ or file:///folder/), without '..'.")
    normal = url if url.endswith("/") else url + "/"
    prefixes = source_prefixes(tenant)
    if not any(normal.startswith(prefix) for prefix in prefixes):
        raise Invalid("url", f"Datasets are registered from {', '.join(prefixes) or 'nowhere on this portal'} "
                             "(DATASET_SOURCE_URLS).")
    digest = hashlib.sha256(normal.encode()).hexdigest()
    version, _created = version_open(actor=actor, tenant=tenant, dataset=dataset, manifest_sha256=digest,
                                     source=normal)
    transaction.on_commit(lambda: send_task("runners.datasets.tasks.version_register", version.id))
    return version


def _source_members(url: str) -> list[packing.Member]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **getattr(settings, "DATASET_SOURCE_OPTIONS", {}))
    root = root.rstrip("/")
    members = []
    for path, info in sorted(fs.find(root, detail=True).items()):
        if info.get("type") != "file" or info.get("islink"):
            continue
        relative = path[len(root):].lstrip("/")
        if not relative:
            continue
        members.append(packing.Member(relative, int(info["size"]), lambda path=path: fs.open(path, "rb")))
    if not members:
        raise Invalid("url", f"{url} holds no files.")
    return members


def version_register_run(version_id: int) -> str:
    """Pack a registered version's files into shards, store them, seal it (the worker's part); failed with why."""
    version = DatasetVersion.objects.select_related("dataset", "dataset__tenant").filter(id=version_id).first()
    if version is None or version.state != VersionState.OPEN:
        return "gone" if version is None else version.state
    _touch(version)
    try:
        blobs = store()
        with tempfile.TemporaryDirectory(prefix="dataset-register-") as work:
            shards = packing.pack(_source_members(version.source), work,
                                  int(getattr(settings, "DATASET_REGISTER_SHARD_BYTES", packing.DEFAULT_SHARD_BYTES)),
                                  progress=lambda _bytes: _touch(version))
            rows = []
            for position, shard in enumerate(shards):
                sha256, size = blobs.put_file(shard.path, shard.sha256)
                _touch(version)
                with open(shard.path, "rb") as handle:
                    members = packing.shard_index(handle)
                rows.append(VersionShard(version=version, position=position, sha256=sha256, bytes=size,
                                         samples=shard.samples, stored=True, members=members))
        with transaction.atomic():
            row = _open_version_locked(version)
            row.shard_rows.all().delete()
            VersionShard.objects.bulk_create(rows)
            _seal_locked(row, [(r.position, True, r.bytes, r.samples, r.members) for r in rows], version.created_by)
        return VersionState.SEALED
    except Conflict:
        # Another run (the sweep sent the registration again) sealed or failed it first: its outcome stands.
        return DatasetVersion.objects.get(id=version.id).state
    except (Invalid, packing.DatasetError, OSError, ValueError) as exc:
        reason = exc.messages[0] if isinstance(exc, Invalid) else str(exc)
        logger.warning("Dataset version %s from %s failed: %s", version.id, version.source, reason)
        DatasetVersion.objects.filter(id=version.id, state=VersionState.OPEN).update(
            state=VersionState.FAILED, reason=f"Could not pack {version.source}: {reason}"[:1000])
        return VersionState.FAILED


# --- The sweep ------------------------------------------------------------------------------------------

UPLOAD_LEASE_S_DEFAULT = 24 * 3600
REGISTER_LEASE_S_DEFAULT = 15 * 60
REGISTER_MAX_SENDS_DEFAULT = 3


def versions_sweep(*, now=None) -> dict:
    """What open versions left behind, put right (the beat's ``runners.datasets.tasks.versions_sweep``):

    - a push abandoned: an open upload with no sign of life for DATASET_UPLOAD_LEASE_S (no declare, no part) is
      discarded, with its stored upload parts; a push of the same folder later opens a new version;
    - a registration whose message was lost (or whose worker died): an open registered version with no sign of
      life for DATASET_REGISTER_LEASE_S is sent to a worker again, at most DATASET_REGISTER_MAX_SENDS times in
      all, then failed with the reason (a run that finds it no longer open does nothing, and of two runs the
      first to seal wins);
    - upload parts of versions no longer open (a discard cut between its row and its files) are removed.

    Answers the counts: {"discarded", "resent", "failed", "orphan_parts"}."""
    now = now or timezone.now()
    upload_lease = timedelta(seconds=int(getattr(settings, "DATASET_UPLOAD_LEASE_S", UPLOAD_LEASE_S_DEFAULT)))
    register_lease = timedelta(seconds=int(getattr(settings, "DATASET_REGISTER_LEASE_S", REGISTER_LEASE_S_DEFAULT)))
    max_sends = int(getattr(settings, "DATASET_REGISTER_MAX_SENDS", REGISTER_MAX_SENDS_DEFAULT))
    done = {"discarded": 0, "resent": 0, "failed": 0, "orphan_parts": 0}
    last_sign = Coalesce("touched_at", "created_at")
    open_versions = DatasetVersion.objects.filter(state=VersionState.OPEN).annotate(last_sign=last_sign)

    for version_id in open_versions.filter(source="upload", last_sign__lt=now - upload_lease).values_list("id", flat=True):
        with transaction.atomic():
            row = (DatasetVersion.objects.select_for_update(skip_locked=True).annotate(last_sign=last_sign)
                   .filter(id=version_id, state=VersionState.OPEN, last_sign__lt=now - upload_lease).first())
            if row is None:  # resumed meanwhile, or being written now
                continue
            gone = DatasetVersion(id=row.id)  # delete() clears the row's id; its parts' folder is named by it
            row.delete()
        _remove_version_parts(gone)
        logger.info("Discarded open version %s of dataset %s: no push touched it since %s.", row.number,
                    row.dataset_id, row.last_sign)
        done["discarded"] += 1

    stale = open_versions.exclude(source="upload").filter(last_sign__lt=now - register_lease)
    for version_id in stale.values_list("id", flat=True):
        with transaction.atomic():
            row = (DatasetVersion.objects.select_for_update(skip_locked=True).annotate(last_sign=last_sign)
                   .filter(id=version_id, state=VersionState.OPEN, last_sign__lt=now - register_lease).first())
            if row is None:
                continue
            if row.register_sends >= max_sends:
                row.state = VersionState.FAILED
                row.reason = (f"The registration from {row.source} was sent to a worker {row.register_sends} times "
                              f"and never finished; register it again.")[:1000]
                row.save(update_fields=["state", "reason"])
                done["failed"] += 1
                continue
            row.register_sends += 1
            row.touched_at = timezone.now()
            row.save(update_fields=["register_sends", "touched_at"])
            transaction.on_commit(lambda version_id=row.id: send_task("runners.datasets.tasks.version_register",
                                                                      version_id))
        logger.warning("Dataset version %s from %s showed no sign of life since %s; its registration is sent "
                       "again (send %s of %s).", row.id, row.source, row.last_sign, row.register_sends, max_sends)
        done["resent"] += 1

    done["orphan_parts"] = _orphan_parts_removed()
    return done


def _orphan_parts_removed() -> int:
    """Remove the upload parts' folders (uploads/<version id>/) of versions that are not open: listed first, then
    the open versions read, so a version opened meanwhile (a new id) is never taken for an orphan."""
    uploads = store(UPLOADS)
    uploads.fs.invalidate_cache(uploads.root)
    try:
        listed = uploads.fs.ls(uploads.root, detail=False)
    except FileNotFoundError:
        return 0
    folders = {int(name): path for path in listed if (name := path.rstrip("/").rsplit("/", 1)[-1]).isdigit()}
    still_open = set(DatasetVersion.objects.filter(id__in=folders, state=VersionState.OPEN).values_list("id", flat=True))
    removed = 0
    for version_id, path in folders.items():
        if version_id in still_open:
            continue
        with contextlib.suppress(FileNotFoundError):
            uploads.fs.rm(path, recursive=True)
        removed += 1
    uploads.fs.invalidate_cache(uploads.root)
    return removed


# --- Uses by jobs ---------------------------------------------------------------------------------------


def spec_pinned(tenant: Tenant, entries) -> tuple[list[dict], list[DatasetVersion]]:
    """A spec's ``datasets`` with every version pinned to a number (the jobs layer's submit): (the entries to
    store, the versions). Raises what selectors.spec_versions raises."""
    found = selectors.spec_versions(tenant, entries)
    return [{"name": reference, "version": version.number} for reference, version in found], [v for _r, v in found]


def uses_record(*, tenant: Tenant, job_id: int, job_name: str, versions: list[DatasetVersion]) -> None:
    """Remember that a job names these versions (in the caller's transaction)."""
    DatasetUse.objects.bulk_create(
        [DatasetUse(version=version, tenant=tenant, job_id=job_id, job_name=job_name[:100]) for version in versions],
        ignore_conflicts=True)


def uses_read(*, job_id: int, records: list[dict]) -> int:
    """Record which versions the job's script opened (the SDK's dataset read records, read back through the
    attempt's progress): each use's ``read_at`` is its first read. A record is matched to a use by the name the
    spec gave the dataset and the version it pinned; one naming anything else is ignored (the script's words
    never add a use). Its time is the script's, so it is kept within the use's creation and now. Answers how
    many uses were marked."""
    uses = list(DatasetUse.objects.filter(job_id=job_id, read_at__isnull=True)
                .select_related("version__dataset__tenant", "tenant"))
    waiting = {(selectors.reference_of(use.version.dataset, use.tenant), use.version.number): use for use in uses}
    marked = 0
    for entry in records:
        use = waiting.pop((entry.get("name"), entry.get("version")), None)
        if use is None:
            continue
        now = timezone.now()
        try:
            said = datetime.fromisoformat(str(entry.get("time")))
        except ValueError:
            said = None
        at = min(max(said, use.created_at), now) if said is not None and not timezone.is_naive(said) else now
        marked += DatasetUse.objects.filter(id=use.id, read_at__isnull=True).update(read_at=at)
    return marked


def verify_stored(sha256: str) -> bool:
    """Whether the stored blob hashes to its name (a sweep's or a test's check; serving checks as it copies)."""
    blobs = store()
    with tempfile.TemporaryDirectory() as work:
        try:
            blobs.fetch(sha256, Path(work) / "blob")
        except HashMismatch:
            return False
    return True

