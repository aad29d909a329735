"""Restore a job's newest durable checkpoint from the store into its job folder, before the ranks start.

The local backend's launch names a ``restore`` in launch.json when the portal's newest durable checkpoint may
not be in the job folder of the node the attempt lands on: {"step", "path" (relative to the job folder),
"job_dir", "manifest" (runners.storage.chunks), "why", "owner" ([uid, gid] for a sandboxed job, else null)}.
``why`` is "elsewhere" (the attempt landed on another node than the one that wrote it: that node's disk is not
this one's), "missing" or "damaged" (the folder's file is gone, or not of the manifest's size), or "check"
(a file of the right size is there: the supervisor hashes it and restores only when it is not the manifest's).

What holds:

- the restored file is the store's bytes, every chunk checked against its key and the whole against the
  manifest's sha256, written under a temporary name and renamed: whole or not there (`chunks.restore`);
- the job folder is the tenant's (a sandboxed script writes there): every folder on the way is opened without
  following a link, and the file is written through the opened folder (``/proc/self/fd``), so a link the
  script put in the path never sends the supervisor's write elsewhere;
- the store's URL and options come in the supervisor's environment (PORTAL_DATA_STORAGE), never in a file.

What it did is ``checkpoint-restore.json`` in the attempt's folder. Pure: no Django, no portal app.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from pathlib import Path, PurePosixPath

RESTORE_RECORD = "checkpoint-restore.json"
STORAGE_VARIABLE = "PORTAL_DATA_STORAGE"
READ_BYTES = 8 << 20


def _open_folder(job_dir: str, parts: tuple[str, ...], owner: tuple[int, int] | None) -> int:
    """A descriptor of the folder ``parts`` under ``job_dir``, each folder opened without following a link
    (made when missing, owned by ``owner`` then). OSError when something on the way is not a folder."""
    fd = os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                os.mkdir(part, 0o755, dir_fd=fd)
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                if owner is not None:
                    os.fchown(child, *owner)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _sha256_of(folder: int, name: str) -> str | None:
    """The sha256 of the regular file ``name`` in the opened folder (never a link, a FIFO or a device); None
    when there is none."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        digest = hashlib.sha256()
        with os.fdopen(os.dup(fd), "rb", buffering=0) as stream:
            while block := stream.read(READ_BYTES):
                digest.update(block)
        return digest.hexdigest()
    finally:
        os.close(fd)


def restore_checkpoint(attempt_dir: Path, launch: dict, environ=os.environ) -> str | None:
    """Restore the launch's checkpoint into its job folder when it is not there whole: None once done (or not
    needed), else why not (the attempt then starts no replica)."""
    plan = launch.get("restore")
    if not plan:
        return None
    from runners.storage import chunks
    from runners.storage.blobs import BlobMissing, BlobStore, HashMismatch

    relative = PurePosixPath(plan["path"])
    if relative.is_absolute() or not relative.parts or ".." in relative.parts:
        return f"Not a checkpoint within its job's folder: {plan['path']!r}."
    step = plan["step"]
    try:
        manifest = chunks.Manifest.from_json(plan["manifest"])
    except ValueError as exc:
        return f"The checkpoint of step {step} cannot be restored: {exc}."
    owner = tuple(plan["owner"]) if plan.get("owner") else None
    started = time.monotonic()
    record = {"step": step, "path": str(relative), "why": plan["why"], "restored": False, "bytes": 0}
    try:
        folder = _open_folder(plan["job_dir"], relative.parts[:-1], owner)
    except OSError as exc:
        return f"The checkpoint of step {step} cannot be restored into the job folder: {exc}."
    try:
        if plan["why"] == "check":
            found = _sha256_of(folder, relative.name)
            if found == manifest.sha256:
                record["why"] = "whole"
            else:
                record["why"] = "damaged" if found else "missing"
        if record["why"] != "whole":
            storage = json.loads(environ.get(STORAGE_VARIABLE) or "{}")
            if not storage.get("url"):
                return (f"The checkpoint of step {step} cannot be restored: the supervisor was given no blob store "
                        f"({STORAGE_VARIABLE}).")
            store = BlobStore(storage["url"], chunks.KIND, storage.get("options") or {})
            destination = Path(f"/proc/self/fd/{folder}") / relative.name
            try:
                record["bytes"] = chunks.restore(store, manifest, destination)
            except BlobMissing as exc:
                return f"The checkpoint of step {step} cannot be restored: a chunk is not in the store ({exc})."
            except HashMismatch as exc:
                return f"The checkpoint of step {step} in the store is damaged; refused: {exc}"
            except OSError as exc:
                return f"The checkpoint of step {step} cannot be restored: {exc}"
            if owner is not None:
                os.chown(relative.name, *owner, dir_fd=folder, follow_symlinks=False)
            record["restored"] = True
    finally:
        os.close(folder)
    record["seconds"] = round(time.monotonic() - started, 3)
    temporary = attempt_dir / f".{RESTORE_RECORD}.tmp"
    temporary.write_text(json.dumps(record))
    os.replace(temporary, attempt_dir / RESTORE_RECORD)
    return None
