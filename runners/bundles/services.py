"""Code bundles: looking one up, where its archive lies, storing an upload once, deleting it.

Lookups for the jobs layer (a ``script`` job names its bundle by digest): ``get_bundle``,
``bundle_url``, ``open_archive``. Storage is fsspec's: BUNDLE_STORAGE_URL is a folder (``file://``)
or a bucket (``s3://bucket/prefix``, s3fs), opened with BUNDLE_STORAGE_OPTIONS.

What holds, whatever fails midway:

- a row always has its archive: the archive is written first (to a temporary name, then moved into
  place, in a folder; a single put, which is atomic, in a bucket), the row after it;
- an upload that fails after its archive was written takes the archive away again, unless a row
  holds it by then;
- uploads and deletes of one tenant's digest take turns (a transaction-level advisory lock), so a
  delete never removes the archive an upload of the same files has just put back.
"""

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import fsspec
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from fsspec.implementations.local import LocalFileSystem
from gpuportal import bundle as bundles

from audit.services import record
from common.errors import Conflict, Invalid, NotFound
from runners.bundles.models import Bundle
from runners.bundles.signals import users_of
from tenants.models import Tenant

logger = logging.getLogger(__name__)

REQUIREMENTS = "requirements.txt"


def storage():
    """(the fsspec filesystem, the root path in it) of BUNDLE_STORAGE_URL."""
    fs, root = fsspec.core.url_to_fs(settings.BUNDLE_STORAGE_URL, **settings.BUNDLE_STORAGE_OPTIONS)
    return fs, root.rstrip("/")


def object_path(tenant: Tenant, sha256: str) -> str:
    """Where a tenant's bundle of this digest lies, as a path of the storage's filesystem."""
    _fs, root = storage()
    return f"{root}/{tenant.slug}/{sha256}.tar.gz"


def get_bundle(tenant: Tenant, sha256: str, *, for_update: bool = False) -> Bundle:
    """The tenant's kept bundle of this digest; raises Bundle.DoesNotExist (a deleted one is gone too).

    ``for_update``: lock its row to the end of the caller's transaction (a job submitted with the
    bundle, so that a delete waits for it and then sees the job)."""
    rows = Bundle.objects.select_related("tenant")
    if for_update:
        rows = rows.select_for_update(of=("self",))
    return rows.get(tenant=tenant, sha256=sha256, deleted_at__isnull=True)


def bundle_url(bundle: Bundle) -> str:
    """The fsspec URL of the bundle's archive (file:///... or s3://...), what a backend fetches it from."""
    fs, _root = storage()
    return fs.unstrip_protocol(object_path(bundle.tenant, bundle.sha256))


def open_archive(bundle: Bundle):
    """The bundle's archive (.tar.gz), as a binary file object opened for reading through fsspec."""
    fs, _root = storage()
    return fs.open(object_path(bundle.tenant, bundle.sha256), "rb")


def mark_used(bundle: Bundle) -> None:
    """A job started from the bundle: remember when (listed as last_used_at)."""
    Bundle.objects.filter(pk=bundle.pk).update(last_used_at=timezone.now())


# --- Limits ------------------------------------------------------------------------------------------


def limits() -> dict:
    """The limits an archive is checked against, from the settings."""
    return {"max_bytes": settings.BUNDLE_MAX_BYTES, "max_members": settings.BUNDLE_MAX_FILES,
            "max_ratio": settings.BUNDLE_MAX_RATIO}


def upload_bound() -> int:
    """The most bytes of an upload read: no archive within the limits is larger."""
    return bundles.archive_bound(settings.BUNDLE_MAX_BYTES, settings.BUNDLE_MAX_FILES)


def too_large_message(largest: list[tuple[str, int]]) -> str:
    """What a 413 says: the limit, and the largest files (those seen before the limit was passed)."""
    limit = settings.BUNDLE_MAX_BYTES
    named = ", ".join(f"{path} ({size} bytes)" for path, size in largest)
    text = f"The bundle is larger than the limit of {limit} bytes unpacked (BUNDLE_MAX_BYTES)."
    if named:
        text += f" Its largest files: {named}. Leave them out with .portalignore, or store them elsewhere."
    return text


def largest_seen(fileobj) -> list[tuple[str, int]]:
    """The largest files of an upload cut short at upload_bound(): read as far as it goes."""
    fileobj.seek(0)
    try:
        bundles.check(fileobj, **limits())
    except bundles.BundleTooLarge as exc:
        return exc.largest
    except bundles.BundleError:
        return []
    return []


# --- Storing -----------------------------------------------------------------------------------------


def lock_digest(tenant: Tenant, sha256: str) -> None:
    """Take turns with every other upload or delete of this tenant's digest, to the end of the transaction."""
    key = int.from_bytes(hashlib.sha256(f"bundle:{tenant.id}:{sha256}".encode()).digest()[:8], "big", signed=True)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [key])


def _exists(fs, path: str) -> bool:
    fs.invalidate_cache(path)
    return fs.exists(path)


def _put(fs, local: str, path: str) -> None:
    """Store the local file at `path`, whole or not at all."""
    parent = path.rsplit("/", 1)[0]
    if isinstance(fs, LocalFileSystem):
        fs.makedirs(parent, exist_ok=True)
        temporary = f"{parent}/.{uuid.uuid4().hex}.part"
        try:
            with open(local, "rb") as source, fs.open(temporary, "wb") as target:
                shutil.copyfileobj(source, target, bundles.CHUNK)
                target.flush()
                os.fsync(target.fileno())
            fs.mv(temporary, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(temporary)
    else:
        # An object store's put is atomic: the object appears whole (a multipart upload on its completion).
        fs.put_file(local, path)


def _remove(fs, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)
    fs.invalidate_cache(path)


def _remove_unless_kept(tenant: Tenant, sha256: str) -> None:
    """Take the archive away unless a kept row holds it (after a failed upload, or a delete)."""
    fs, _root = storage()
    try:
        with transaction.atomic():
            lock_digest(tenant, sha256)
            if not Bundle.objects.filter(tenant=tenant, sha256=sha256, deleted_at__isnull=True).exists():
                _remove(fs, object_path(tenant, sha256))
    except Exception:  # noqa: BLE001 - a left archive without a row is harmless: nothing lists or runs it
        logger.exception("Could not remove the archive of bundle %s/%s; it is left without a row.", tenant.slug, sha256)


def _audit_fields(bundle: Bundle) -> dict:
    return {"sha256": bundle.sha256, "size_bytes": bundle.size_bytes, "unpacked_bytes": bundle.unpacked_bytes,
            "files": bundle.files, "has_requirements": bundle.has_requirements}


def store(tenant: Tenant, user, fileobj) -> tuple[Bundle, bool]:
    """Check an uploaded .tar.gz (a seekable binary file) and keep it once: (the bundle, whether it is new).

    Raises gpuportal.bundle.BundleError for a member no bundle may hold (BundleTooLarge past
    BUNDLE_MAX_BYTES) and Invalid for an archive without files. The stored archive is the server's
    own canonical packing of what it checked, so the same files always give the same bytes.
    """
    fileobj.seek(0)
    members = bundles.check(fileobj, **limits())
    if not members:
        raise Invalid("archive", "The archive holds no files.")
    sha256 = bundles.members_digest(members)
    fs, _root = storage()
    path = object_path(tenant, sha256)
    try:
        existing = get_bundle(tenant, sha256)
    except Bundle.DoesNotExist:
        existing = None
    if existing is not None and _exists(fs, path):
        return existing, False
    with tempfile.TemporaryDirectory(prefix="bundle-") as work:
        fileobj.seek(0)
        bundles.extract(fileobj, Path(work) / "files", **limits())
        canonical = Path(work) / "canonical.tar.gz"
        with open(canonical, "wb") as out:
            repacked = bundles.pack_to(Path(work) / "files", out, ignore=False)
        if bundles.members_digest(repacked) != sha256:
            raise RuntimeError(f"Bundle {sha256}: the repacked files do not have the digest that was checked.")
        wrote = False
        try:
            with transaction.atomic():
                lock_digest(tenant, sha256)
                existing = Bundle.objects.filter(tenant=tenant, sha256=sha256, deleted_at__isnull=True).first()
                if existing is None or not _exists(fs, path):
                    _put(fs, str(canonical), path)
                    wrote = existing is None
                if existing is not None:
                    return existing, False
                bundle = Bundle.objects.create(
                    tenant=tenant, sha256=sha256, size_bytes=canonical.stat().st_size,
                    unpacked_bytes=sum(member.size for member in members), files=len(members),
                    has_requirements=any(member.path == REQUIREMENTS for member in members),
                    created_by=user if getattr(user, "is_authenticated", False) else None,
                )
                record("bundle.uploaded", actor=user, tenant=tenant, obj=bundle, after=_audit_fields(bundle))
        except BaseException:
            if wrote:
                _remove_unless_kept(tenant, sha256)
            raise
    return bundle, True


def delete(bundle: Bundle, *, actor=None) -> None:
    """Delete a bundle: its archive is removed and its row kept as deleted (the ledger charges its storage
    up to now). Refused (Conflict, naming them) while queued or running jobs use it."""
    tenant = bundle.tenant
    with transaction.atomic():
        lock_digest(tenant, bundle.sha256)
        row = Bundle.objects.select_for_update().filter(pk=bundle.pk, deleted_at__isnull=True).first()
        if row is None:
            raise NotFound("No such bundle.")
        users = users_of(row)
        if users:
            raise Conflict(f"The bundle is used by {', '.join(users)}; delete it once they have finished.")
        row.deleted_at = timezone.now()
        row.save(update_fields=["deleted_at"])
        record("bundle.deleted", actor=actor, tenant=tenant, obj=row, before=_audit_fields(row))
        # Once the delete is committed (a caller's transaction that rolls back keeps the archive too).
        transaction.on_commit(lambda: _remove_unless_kept(tenant, bundle.sha256))
    bundle.deleted_at = row.deleted_at
