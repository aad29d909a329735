"""The checkpoint store: each checkpoint a job writes is copied, in the background, into the blob store as
deduplicated chunks (runners.storage.chunks), under the tenant's storage quota and retention policy.

The training script never waits for it: the SDK writes the checkpoint to the job's folder and returns; the
reconcile's progress read records the checkpoint (store_state "pending") and sends ``checkpoint_store`` by
name, and a worker claims it under a lease, reads the file through the backend (``job_checkpoint``, which
never follows the sandboxed script's links) once, cutting it into chunks and storing those the store lacks
as it reads, reserves their bytes against the quota, and only then records the checkpoint durable. On
Kubernetes the pods' uploader does the cutting and sends the chunks (runners.jobs.checkpoint_upload).

The agent's cost beside training is kept small: one read, each byte hashed once for its chunk and once for the
whole file, at idle CPU priority in a thread of its own (``at_low_priority``); and when it is behind, a
checkpoint a newer one supersedes that retention would not keep is skipped (``_superseded_by``). A worker
that dies mid-upload leaves its checkpoint storing past its lease; the sweep asks for it again.

What holds, and how:

- The storage quota counts the store's bytes after deduplication: each chunk once per tenant, over its
  checkpoints being stored or durable. A checkpoint's chunks are reserved (its manifest written, state
  "storing") under the tenant's advisory lock, so concurrent saves are admitted one at a time against what
  the others reserved. A save that would pass the quota first applies the tenant's retention, then fails with
  the reason on the checkpoint and as the job's event.
- A chunk is deleted only when no manifest of a checkpoint being stored or durable names it. The sweep holds
  the store's advisory lock exclusively while it lists what is named and deletes the rest; an upload checks
  that its chunks are all there, and records the checkpoint durable, under the same lock held shared. A chunk
  an upload found present and the sweep deleted meanwhile is stored again before the checkpoint is durable.
- Retention (runners.storage.retention) discards durable checkpoints only, never one being stored, and
  never the newest durable checkpoint of a job that may still resume from it.
- What the ledger charges a tenant's checkpoints is, at every moment, the bytes of the distinct chunks its
  durable checkpoints name: each chunk's charge is carried by the first of them stored that names it (its
  stored_bytes, set at the seal), and a discard hands what it carried and a kept one still names to that one
  (``checkpoints_discard``); seals and discards of a tenant take its lock, so none comes between another's
  weighing and writing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import tempfile
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.db import connection, models, transaction
from django.utils import timezone

from common.dispatch import send_task
from quotas.models import TenantStorage
from runners.backends.base import BackendError, CheckpointElsewhere, CheckpointGone, TransientBackendError
from runners.clusters.registry import get_backend
from runners.jobs.models import JOB_FINAL_STATES, Checkpoint, CheckpointHandover, Job, JobEvent, JobMetric
from runners.storage import chunks, retention
from runners.storage.blobs import BlobStore

logger = logging.getLogger(__name__)

BYTES_PER_GB = 10**9
# The two advisory lock classes (pg_advisory_xact_lock(class, id)): one tenant's quota and charges (a
# reservation, a seal, a discard), and the store's chunks (the sweep exclusive, an upload's last check shared).
# A seal takes the tenant's first, then the store's.
TENANT_QUOTA_LOCK = 35_001
STORE_CHUNKS_LOCK = 35_002
HOLDING = ("storing", "durable")
# How long a worker (or a pod's uploader) holds a checkpoint it is storing before the sweep takes it for a dead
# one's and asks again; renewed every third of it while the work goes on.
STORE_LEASE_S = 600
# The spool's reads and writes: large, so the copy is a few system calls per checkpoint, not thousands.
SPOOL_BUFFER_BYTES = 8 << 20
# The CPU priority of the agent's hashing, chunking and copying (CHECKPOINT_STORE_PRIORITY): "idle" runs it
# under SCHED_IDLE (only when a core would otherwise idle) and nice 19, "nice" at nice 19 only, "normal" as is.
PRIORITIES = ("idle", "nice", "normal")


class StoreRefused(Exception):
    """The checkpoint cannot be stored (its quota, its file gone); the message says why."""


def checkpoint_blobs() -> BlobStore:
    return BlobStore(settings.DATA_STORAGE_URL, chunks.KIND, settings.DATA_STORAGE_OPTIONS)


def store_enabled() -> bool:
    return bool(getattr(settings, "CHECKPOINT_STORE_ENABLED", True))


def _lock(lock_class: int, key: int, *, shared: bool = False) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT pg_advisory_xact_lock{'_shared' if shared else ''}(%s, %s)", [lock_class, key])


# --- What a tenant stores ---------------------------------------------------------------------------

_TENANT_CHUNKS = """
    SELECT DISTINCT chunk->>0 AS sha256, (chunk->>1)::bigint AS size
    FROM runners_checkpoint checkpoint
    JOIN runners_job job ON job.id = checkpoint.job_id,
    jsonb_array_elements(checkpoint.manifest->'chunks') chunk
    WHERE job.tenant_id = %s AND checkpoint.store_state IN ('storing', 'durable')
"""


def tenant_stored_bytes(tenant_id: int) -> int:
    """The store's bytes the tenant's checkpoints hold (stored or being stored), each chunk counted once."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT COALESCE(SUM(size), 0) FROM ({_TENANT_CHUNKS}) held", [tenant_id])
        return int(cursor.fetchone()[0])


def _tenant_holds(tenant_id: int, sha256s: list[str]) -> set[str]:
    if not sha256s:
        return set()
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT sha256 FROM ({_TENANT_CHUNKS}) held WHERE sha256 = ANY(%s)", [tenant_id, sha256s])
        return {row[0] for row in cursor.fetchall()}


# The charge of each distinct chunk a tenant's durable checkpoints name is carried by the first of them stored
# (durable_at, then id) that names it. A checkpoint made durable carries the chunks no durable one named (its
# stored_bytes), so a seal never moves another's charge; a discard moves the chunks the discarded carried that
# a kept one still names to the first kept one that names them (a handover). Chunks are deduplicated per
# tenant, across its jobs, so a carrier may be another job's checkpoint of the same tenant.
_DURABLE_HOLDS = """
    SELECT DISTINCT chunk->>0
    FROM runners_checkpoint checkpoint
    JOIN runners_job job ON job.id = checkpoint.job_id,
    jsonb_array_elements(checkpoint.manifest->'chunks') chunk
    WHERE job.tenant_id = %s AND checkpoint.store_state = 'durable' AND chunk->>0 = ANY(%s)
"""
_CARRIED = """
    SELECT carrier, SUM(size) FROM (
        SELECT DISTINCT ON (chunk->>0) checkpoint.id AS carrier, (chunk->>1)::bigint AS size
        FROM runners_checkpoint checkpoint
        JOIN runners_job job ON job.id = checkpoint.job_id,
        jsonb_array_elements(checkpoint.manifest->'chunks') chunk
        WHERE job.tenant_id = %s AND checkpoint.store_state = 'durable' AND checkpoint.id <> ALL(%s)
          AND chunk->>0 IN (SELECT named->>0 FROM runners_checkpoint discarded,
                            jsonb_array_elements(discarded.manifest->'chunks') named WHERE discarded.id = ANY(%s))
        ORDER BY chunk->>0, checkpoint.durable_at, checkpoint.id
    ) carried GROUP BY carrier
"""


def _durable_adds(tenant_id: int, manifest: chunks.Manifest) -> int:
    """The bytes of the manifest's chunks that no durable checkpoint of the tenant names."""
    sizes = {chunk.sha256: chunk.bytes for chunk in manifest.chunks}
    with connection.cursor() as cursor:
        cursor.execute(_DURABLE_HOLDS, [tenant_id, list(sizes)])
        held = {row[0] for row in cursor.fetchall()}
    return sum(size for sha256, size in sizes.items() if sha256 not in held)


def _carried(tenant_id: int, discard: list[int], *, without: list[int]) -> dict[int, int]:
    """Per durable checkpoint of the tenant (less ``without``), the bytes it carries of the chunks that the
    ``discard`` checkpoints name."""
    with connection.cursor() as cursor:
        cursor.execute(_CARRIED, [tenant_id, without, discard])
        return {carrier: int(size) for carrier, size in cursor.fetchall()}


def tenant_quota_bytes(tenant_id: int) -> int | None:
    quota_gb = TenantStorage.objects.filter(tenant_id=tenant_id).values_list("quota_gb", flat=True).first()
    return None if quota_gb is None else int(Decimal(quota_gb) * BYTES_PER_GB)


def _gb(size: int) -> str:
    return f"{size / BYTES_PER_GB:.3f}"


# --- Storing one checkpoint -------------------------------------------------------------------------


def checkpoints_store_ask(job_id: int) -> None:
    """Send ``checkpoint_store`` for each of the job's checkpoints waiting to be stored (after commit)."""
    for checkpoint_id in Checkpoint.objects.filter(job_id=job_id, store_state="pending").values_list("id", flat=True):
        send_task("runners.jobs.tasks.checkpoint_store", checkpoint_id)


def lease_until() -> datetime:
    return timezone.now() + timedelta(seconds=float(getattr(settings, "CHECKPOINT_STORE_LEASE_S", STORE_LEASE_S)))


def _spool(opened, target: Path) -> str:
    """Copy the opened checkpoint into the worker's own file, hashing it in the same read; its sha256."""
    digest = hashlib.sha256()
    with open(target, "wb") as spool:
        if opened.stream is not None:
            buffer = memoryview(bytearray(SPOOL_BUFFER_BYTES))
            reader = getattr(opened.stream, "readinto", None)
            while True:
                if reader is not None:
                    count = reader(buffer)
                    piece = buffer[:count] if count else b""
                else:
                    piece = opened.stream.read(SPOOL_BUFFER_BYTES)
                if not piece:
                    break
                digest.update(piece)
                spool.write(piece)
        else:
            for piece in opened.chunks:
                digest.update(piece)
                spool.write(piece)
    return digest.hexdigest()


def _lower_own_priority(priority: str) -> None:
    """Lower the calling thread's CPU priority (Linux: nice and the scheduling policy are per thread); what
    the kernel refuses is left as it is."""
    if priority == "normal":
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, 19)
    except (OSError, AttributeError):
        pass
    if priority == "idle":
        try:
            os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            pass


def at_low_priority(work, *args):
    """Run ``work(*args)`` in a thread of its own at the agent's priority (CHECKPOINT_STORE_PRIORITY) and
    return what it returns (or raise what it raised). The thread ends with the work, so the worker's own
    priority is never lowered for its other tasks. No database access in ``work``."""
    priority = getattr(settings, "CHECKPOINT_STORE_PRIORITY", "idle")
    if priority not in PRIORITIES:
        priority = "idle"
    outcome: dict = {}

    def run() -> None:
        _lower_own_priority(priority)
        try:
            outcome["value"] = work(*args)
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="checkpoint-store", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


class _LeaseRenewed:
    """Renew a storing checkpoint's lease every third of its length while the block runs (a thread of its
    own, with its own database connection, closed at the end)."""

    def __init__(self, checkpoint_id: int):
        self.checkpoint_id = checkpoint_id
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._renew, name="checkpoint-lease", daemon=True)

    def _renew(self) -> None:
        every = float(getattr(settings, "CHECKPOINT_STORE_LEASE_S", STORE_LEASE_S)) / 3
        try:
            while not self.done.wait(every):
                Checkpoint.objects.filter(id=self.checkpoint_id, store_state="storing").update(
                    store_lease_until=lease_until())
        except Exception:  # a lease that is not renewed runs out; the sweep then asks again
            logger.exception("Could not renew the store lease of checkpoint %s", self.checkpoint_id)
        finally:
            connection.close()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        return False


def _regular_file(opened) -> bool:
    """Whether the opened checkpoint is a regular file read by its descriptor (the local backend's job folder),
    which ``chunks.store_open`` reads in place: a folder's tar stream is spooled first."""
    stream = opened.stream
    try:
        return stream is not None and stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (AttributeError, OSError, ValueError):
        return False


def _prepare(opened, folder: Path) -> tuple[Path, chunks.Manifest]:
    """The agent's CPU work before the quota is asked: the checkpoint copied into the worker's own file (hashed
    in the same read, large buffers), then cut into chunks, each hashed once."""
    spool = folder / "checkpoint"
    try:
        whole = _spool(opened, spool)
    finally:
        opened.close()
    return spool, chunks.split(spool, sha256=whole)


def _event(job: Job, reason: str) -> None:
    JobEvent.objects.create(job=job, from_state=job.state, to_state=job.state, reason=reason[:1000])


def checkpoint_fail(checkpoint: Checkpoint, reason: str) -> None:
    with transaction.atomic():
        changed = Checkpoint.objects.filter(id=checkpoint.id, store_state="storing").update(
            store_state="failed", store_reason=reason[:500], manifest=None, stored_bytes=0, store_lease_until=None)
        if changed:
            _event(checkpoint.job, reason)
    logger.warning("Checkpoint %s of job %s not stored: %s", checkpoint.step, checkpoint.job_id, reason)


def checkpoint_reserve(checkpoint: Checkpoint, manifest: chunks.Manifest) -> None:
    """Record the manifest (its chunks' bytes now count against the quota) if the quota has room, after
    applying the tenant's retention once if it has not; StoreRefused otherwise."""
    job = checkpoint.job
    sha256s = list(dict.fromkeys(chunk.sha256 for chunk in manifest.chunks))
    sizes = {chunk.sha256: chunk.bytes for chunk in manifest.chunks}
    freed = 0
    for tries in range(2):
        with transaction.atomic():
            _lock(TENANT_QUOTA_LOCK, job.tenant_id)
            quota = tenant_quota_bytes(job.tenant_id)
            new = sum(sizes[sha256] for sha256 in set(sha256s) - _tenant_holds(job.tenant_id, sha256s))
            used = tenant_stored_bytes(job.tenant_id)
            if quota is None or used + new <= quota:
                Checkpoint.objects.filter(id=checkpoint.id, store_state="storing").update(
                    manifest=manifest.to_json(), stored_bytes=new)
                return
        if tries == 0:
            freed = sum(item["bytes_freed"] for item in retention_apply(tenant_id=job.tenant_id))
    raise StoreRefused(
        f"Checkpoint of step {checkpoint.step} not stored: it adds {_gb(new)} GB and tenant {job.tenant.slug} "
        f"stores {_gb(used)} GB of its {_gb(quota)} GB checkpoint storage quota (its retention policy freed "
        f"{_gb(freed)} GB first). Lower the retention's counts or ask for a larger quota.")


def _superseded_by(checkpoint: Checkpoint) -> Checkpoint | None:
    """The newer checkpoint that lets this one be skipped when the agent fell behind: one of the job's is
    already waiting to be stored, being stored or durable, and the job's retention policy would not keep this
    one anyway (a policy that keeps everything never skips). None: store it."""
    job = checkpoint.job
    newer = (Checkpoint.objects.filter(job_id=job.id, store_state__in=("pending", "storing", "durable"),
                                       step__gt=checkpoint.step)
             .order_by("-step").first())
    if newer is None:
        return None
    policy = job_policy(job, tenant_policy(job.tenant_id))
    if policy.keeps_everything:
        return None
    rows = list(Checkpoint.objects.filter(job_id=job.id).values_list("id", "step", "store_state"))
    losses = dict(JobMetric.objects.filter(job_id=job.id, loss__isnull=False, step__in=[row[1] for row in rows])
                  .order_by("step", "attempt").values_list("step", "loss"))
    history = [retention.StoredCheckpoint(row_id, step, losses.get(step)) for row_id, step, _ in rows]
    # What retention weighs it against: the checkpoints that are or will be in the store, itself included.
    alive = {row_id for row_id, _, state in rows if state in ("pending", "storing", "durable")} | {checkpoint.id}
    if checkpoint.id in retention.kept(policy, history, candidates=alive):
        return None
    return newer


def checkpoint_store_run(checkpoint_id: int) -> str:
    """Store one pending checkpoint; what became of it."""
    if not Checkpoint.objects.filter(id=checkpoint_id, store_state="pending").update(
            store_state="storing", store_lease_until=lease_until()):
        return "not pending"
    checkpoint = Checkpoint.objects.select_related("job__environment", "job__tenant").get(id=checkpoint_id)
    job = checkpoint.job
    newer = _superseded_by(checkpoint)
    if newer is not None:
        Checkpoint.objects.filter(id=checkpoint_id, store_state="storing").update(
            store_state="skipped", store_lease_until=None,
            store_reason=f"Not stored: the checkpoint of step {newer.step} came before the store reached it, "
                         "and the retention policy would not keep this one.")
        return "skipped"
    folder = Path(tempfile.mkdtemp(prefix=f"checkpoint-{checkpoint_id}-"))
    try:
        try:
            opened = get_backend().job_checkpoint(job.id, job.environment.namespace, checkpoint.uri)
        except CheckpointElsewhere as exc:
            Checkpoint.objects.filter(id=checkpoint_id, store_state="storing").update(
                store_state="", store_reason=str(exc)[:500], store_lease_until=None)
            return "elsewhere"
        except CheckpointGone:
            checkpoint_fail(checkpoint, f"Checkpoint of step {checkpoint.step} not stored: its file was deleted first.")
            return "gone"
        store = checkpoint_blobs()
        with _LeaseRenewed(checkpoint_id):
            if _regular_file(opened):
                # One read of the file: cut, hashed and the chunks the store lacks stored as they come, then
                # reserved. A refused one's chunks are left to the sweep, which collects what nothing names.
                try:
                    manifest, _written = at_low_priority(chunks.store_open, store, opened.stream)
                finally:
                    opened.close()
                spool = None
            else:
                spool, manifest = at_low_priority(_prepare, opened, folder)
            try:
                checkpoint_reserve(checkpoint, manifest)
            except StoreRefused as exc:
                checkpoint_fail(checkpoint, str(exc))
                return "refused"
            if spool is not None:
                # The spool is the worker's own copy, cut into this very manifest: no chunk is hashed again.
                at_low_priority(lambda: chunks.store_chunks(store, spool, manifest, verify=False))
            sealed = checkpoint_seal(checkpoint_id, manifest, store=store, spool=spool)
            if sealed == "incomplete":  # a sweep collected a chunk before the reservation named it
                raise OSError("a chunk was collected before the checkpoint was reserved; stored again next try")
            return sealed
    except (BackendError, OSError) as exc:
        # Asked again by the task's retry; what it reserved is released meanwhile.
        Checkpoint.objects.filter(id=checkpoint_id, store_state="storing").update(
            store_state="pending", manifest=None, stored_bytes=0, store_lease_until=None)
        raise TransientBackendError(f"Checkpoint {checkpoint_id} not stored yet: {exc}") from exc
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def checkpoint_seal(checkpoint_id: int, manifest: chunks.Manifest, *, store: BlobStore | None = None,
                    spool: Path | None = None, now: datetime | None = None) -> str:
    """Record a storing checkpoint durable once the store holds every chunk of its manifest, checked under the
    store's lock (shared), so no sweep deletes one meanwhile. A chunk missing is stored again from ``spool``
    when given; without it (a pod's upload) the checkpoint stays storing and the answer is "incomplete".
    "lost": the checkpoint is no longer this manifest's (its lease ran out and it was asked for again).

    Its stored_bytes become what it adds to the tenant's durable checkpoints, weighed under the tenant's lock
    so no other seal or discard of the tenant comes between: the bytes the ledger charges it."""
    store = store or checkpoint_blobs()
    tenant_id = Checkpoint.objects.filter(id=checkpoint_id).values_list("job__tenant_id", flat=True).first()
    if tenant_id is None:
        return "lost"
    with transaction.atomic():
        _lock(TENANT_QUOTA_LOCK, tenant_id)
        _lock(STORE_CHUNKS_LOCK, 0, shared=True)
        lacking = chunks.missing(store, manifest)
        if lacking and spool is not None:  # collected by a sweep between our put and now
            chunks.store_chunks(store, spool, manifest, only=lacking, verify=False)
        elif lacking:
            return "incomplete"
        changed = Checkpoint.objects.filter(id=checkpoint_id, store_state="storing",
                                            manifest__sha256=manifest.sha256).update(
            store_state="durable", durable_at=now or timezone.now(), stored_bytes=_durable_adds(tenant_id, manifest),
            store_reason="", store_lease_until=None)
    return "durable" if changed else "lost"


# --- Reading one back -------------------------------------------------------------------------------


def checkpoint_bytes(checkpoint: Checkpoint) -> BinaryIO:
    """The checkpoint's bytes as an open file: the job folder's copy when the backend still has it there,
    else the store's (joined from its chunks, each checked). StoreRefused when neither has it."""
    job = checkpoint.job
    try:
        opened = get_backend().job_checkpoint(job.id, job.environment.namespace, checkpoint.uri)
    except BackendError:
        opened = None
    if opened is not None:
        if opened.stream is not None:
            return opened.stream
        opened.close()  # a folder: its tar is rebuilt from the store's copy, which has it whole
    if checkpoint.store_state != "durable" or not checkpoint.manifest:
        raise StoreRefused(f"Checkpoint of step {checkpoint.step} of job {job.name} #{job.id} is neither in its "
                           "job's folder nor in the checkpoint store.")
    handle = tempfile.TemporaryFile(prefix="checkpoint-")
    folder = Path(tempfile.mkdtemp(prefix="checkpoint-restore-"))
    try:
        chunks.restore(checkpoint_blobs(), chunks.Manifest.from_json(checkpoint.manifest), folder / "file")
        with open(folder / "file", "rb") as source:
            shutil.copyfileobj(source, handle, 1 << 20)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    handle.seek(0)
    return handle


def checkpoint_restore(checkpoint: Checkpoint, destination: str | Path) -> int:
    """Write the store's copy of a durable checkpoint to a local path (checked, atomic); its bytes."""
    if checkpoint.store_state != "durable" or not checkpoint.manifest:
        raise StoreRefused(f"Checkpoint of step {checkpoint.step} is not in the checkpoint store.")
    return chunks.restore(checkpoint_blobs(), chunks.Manifest.from_json(checkpoint.manifest), destination)


# --- Retention --------------------------------------------------------------------------------------


def tenant_policy(tenant_id: int) -> retention.RetentionPolicy:
    data = TenantStorage.objects.filter(tenant_id=tenant_id).values_list("retention", flat=True).first()
    return retention.parse_policy(data)


def job_policy(job: Job, tenant_default: retention.RetentionPolicy) -> retention.RetentionPolicy:
    data = (job.spec or {}).get("checkpoint_retention")
    return tenant_default if data is None else retention.parse_policy(data)


@dataclass
class _JobPlan:
    job: Job
    discard: set[int]
    rows: dict[int, dict]


def _plans(tenant_id: int, tenant_default: retention.RetentionPolicy, *, job_ids=None,
           job_override: retention.RetentionPolicy | None = None) -> list[_JobPlan]:
    jobs = Job.objects.filter(tenant_id=tenant_id, checkpoints__store_state="durable").distinct().order_by("id")
    if job_ids is not None:
        jobs = jobs.filter(id__in=job_ids)
    plans = []
    for job in jobs:
        policy = job_override or job_policy(job, tenant_default)
        if policy.keeps_everything:
            continue
        rows = {row["id"]: row for row in Checkpoint.objects.filter(job=job).values(
            "id", "step", "store_state", "manifest")}
        losses = dict(JobMetric.objects.filter(job=job, step__in=[row["step"] for row in rows.values()],
                                               loss__isnull=False)
                      .order_by("step", "attempt").values_list("step", "loss"))
        history = [retention.StoredCheckpoint(row_id, row["step"], losses.get(row["step"]))
                   for row_id, row in rows.items()]
        durable = [row_id for row_id, row in rows.items() if row["store_state"] == "durable"]
        protected = set()
        if job.state not in JOB_FINAL_STATES and durable:
            protected.add(max(durable, key=lambda row_id: rows[row_id]["step"]))
        discard = retention.freed(policy, history, candidates=durable, protected=protected)
        if discard:
            plans.append(_JobPlan(job, discard, rows))
    return plans


def _bytes_freed(tenant_id: int, discard: set[int]) -> int:
    """What the store's bytes of the tenant drop by when these checkpoints go (chunks others name stay)."""
    if not discard:
        return 0
    with connection.cursor() as cursor:
        cursor.execute(f"""
            SELECT COALESCE(SUM(size), 0) FROM ({_TENANT_CHUNKS.replace("WHERE", "WHERE checkpoint.id <> ALL(%s) AND")}) kept
        """, [list(discard), tenant_id])
        kept = int(cursor.fetchone()[0])
    return tenant_stored_bytes(tenant_id) - kept


def retention_preview(*, tenant_id: int, policy: retention.RetentionPolicy | None = None,
                      job_id: int | None = None) -> dict:
    """What a policy would free now: the checkpoints per job and the bytes the tenant's store drops by.

    ``policy`` None previews the saved ones; given with ``job_id``, it is that job's; given without, the
    tenant's (for the jobs that follow the tenant's)."""
    default = tenant_policy(tenant_id) if policy is None or job_id is not None else policy
    plans = _plans(tenant_id, default, job_ids=None if job_id is None else [job_id],
                   job_override=policy if job_id is not None else None)
    discard = set().union(*(plan.discard for plan in plans)) if plans else set()
    return {
        "checkpoints": sum(len(plan.discard) for plan in plans),
        "bytes_freed": _bytes_freed(tenant_id, discard),
        "stored_bytes": tenant_stored_bytes(tenant_id),
        "jobs": [{"job": plan.job.id, "name": plan.job.name,
                  "steps": sorted(plan.rows[row_id]["step"] for row_id in plan.discard)} for plan in plans],
    }


def checkpoints_discard(*, tenant_id: int, checkpoint_ids, now: datetime | None = None) -> int:
    """Discard these durable checkpoints of the tenant; how many went.

    Their chunks that a kept checkpoint still names stay in the store, and so does their charge: what the
    discarded carried of those is handed over to the first kept checkpoint that names them, charged to it
    from now on (a CheckpointHandover). Under the tenant's lock, so no seal or other discard comes between."""
    now = now or timezone.now()
    with transaction.atomic():
        _lock(TENANT_QUOTA_LOCK, tenant_id)
        discard = list(Checkpoint.objects.filter(id__in=list(checkpoint_ids), job__tenant_id=tenant_id,
                                                 store_state="durable").values_list("id", flat=True))
        if not discard:
            return 0
        before = _carried(tenant_id, discard, without=[])
        after = _carried(tenant_id, discard, without=discard)
        CheckpointHandover.objects.bulk_create([
            CheckpointHandover(checkpoint_id=carrier, bytes=size - before.get(carrier, 0), handed_at=now)
            for carrier, size in sorted(after.items()) if size > before.get(carrier, 0)
        ])
        return Checkpoint.objects.filter(id__in=discard).update(store_state="discarded", discarded_at=now,
                                                                manifest=None)


def retention_apply(*, tenant_id: int, now: datetime | None = None) -> list[dict]:
    """Discard what the tenant's policies (its own, its jobs') do not keep; per job, what went."""
    now = now or timezone.now()
    done = []
    for plan in _plans(tenant_id, tenant_policy(tenant_id)):
        freed = _bytes_freed(tenant_id, plan.discard)
        changed = checkpoints_discard(tenant_id=tenant_id, checkpoint_ids=plan.discard, now=now)
        if changed:
            done.append({"job": plan.job.id, "checkpoints": changed, "bytes_freed": freed})
    return done


def chunks_collect() -> dict:
    """Delete every chunk no checkpoint being stored or durable names (the store's own lock held)."""
    with transaction.atomic():
        _lock(STORE_CHUNKS_LOCK, 0)
        with connection.cursor() as cursor:
            cursor.execute("""
                SELECT DISTINCT chunk->>0 FROM runners_checkpoint,
                jsonb_array_elements(manifest->'chunks') chunk
                WHERE store_state IN ('storing', 'durable') AND manifest IS NOT NULL
            """)
            referenced = {row[0] for row in cursor.fetchall()}
        count, freed = chunks.collect(checkpoint_blobs(), referenced)
    return {"chunks_deleted": count, "bytes_deleted": freed}


def checkpoints_stuck_release(now: datetime | None = None) -> list[int]:
    """Put back to pending every checkpoint left storing past its lease (the worker that held it died
    mid-upload): its reservation released, its chunks collected by the sweep unless another names them.
    The ids released; the caller asks for them (``checkpoints_store_ask``)."""
    now = now or timezone.now()
    stuck = Checkpoint.objects.filter(store_state="storing").filter(
        models.Q(store_lease_until__lt=now) | models.Q(store_lease_until__isnull=True))
    released = []
    for checkpoint_id in stuck.values_list("id", flat=True):
        # Each one conditionally: a worker renewing its lease meanwhile keeps it.
        if Checkpoint.objects.filter(id=checkpoint_id, store_state="storing").filter(
                models.Q(store_lease_until__lt=now) | models.Q(store_lease_until__isnull=True)).update(
                store_state="pending", manifest=None, stored_bytes=0, store_lease_until=None,
                store_reason="Asked again: the worker storing it stopped holding it (its lease ran out)."):
            released.append(checkpoint_id)
    if released:
        logger.warning("Checkpoints %s were left storing past their lease; asked for again", released)
    return released


def checkpoints_sweep_run() -> dict:
    """The beat's sweep: every tenant's retention applied, then the chunks nothing names collected."""
    # A checkpoint a dead worker left storing (its lease ran out) is released and asked for again; a pending
    # checkpoint whose message was lost is asked for again.
    checkpoints_stuck_release()
    waiting = Checkpoint.objects.filter(store_state="pending", created_at__lt=timezone.now() - timedelta(minutes=1))
    for job_id in set(waiting.values_list("job_id", flat=True)):
        checkpoints_store_ask(job_id)
    tenant_ids = set(Job.objects.filter(checkpoints__store_state="durable").values_list("tenant_id", flat=True))
    discarded = 0
    for tenant_id in sorted(tenant_ids):
        discarded += sum(item["checkpoints"] for item in retention_apply(tenant_id=tenant_id))
    return {"checkpoints_discarded": discarded, **chunks_collect()}
