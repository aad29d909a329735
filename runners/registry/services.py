"""The model registry's writes: promote a job's checkpoint to a new version of a named model, delete a version,
and sweep the weights no kept version names.

Promotion copies the checkpoint's bytes into the content-addressed store (DATA_STORAGE_URL, kind "models")
before the version's row is written, so a row always has its weights, and the weights are the version's own:
the job's checkpoints may be collected and the job deleted afterwards, and the version still serves. The bytes
are read with ``runners.jobs.checkpoint_store.checkpoint_bytes``: the job folder's copy where the backend has
it, else the checkpoint store's durable copy, so a checkpoint on a Kubernetes claim is promoted once its pod
has uploaded it. The copy is made with no lock held; the numbering of the version takes the (tenant, name)
lock, and the row is written under the weights lock held shared (see WEIGHTS_LOCK).

Versions are immutable: nothing here changes one. Promoting the checkpoint a version of the same name
already holds (same job, step and bytes) answers that version again, so a deploy from a job's checkpoint,
repeated, does not mint a version each time.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import re
import tempfile

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import connection, transaction
from django.db.models import Max
from django.utils import timezone

from audit.services import record
from common.dispatch import send_task
from common.errors import Conflict, Invalid, NotFound
from runners.backends.base import BackendError, CheckpointElsewhere, CheckpointGone
from runners.clusters.registry import get_backend
from runners.jobs import checkpoint_store
from runners.jobs import selectors as job_selectors
from runners.jobs.models import Checkpoint, Job, JobMetric
from runners.registry import selectors as registry_selectors
from runners.registry import signals
from runners.registry.models import MODEL_NAME_MAX, MODEL_NAME_PATTERN, ModelVersion, WeightsFormat
from runners.storage.blobs import BlobMissing, BlobStore
from tenants.models import Role, Tenant
from tenants.services import require_role

logger = logging.getLogger(__name__)

WEIGHTS_KIND = "models"
PROMOTE_FIELDS = ("name", "job", "step")
# Blocks of a checkpoint copied into the store at a time.
COPY_CHUNK = 1 << 20


def weights_store() -> BlobStore:
    """The store model weights are kept in (DATA_STORAGE_URL, kind "models")."""
    return BlobStore(settings.DATA_STORAGE_URL, WEIGHTS_KIND, settings.DATA_STORAGE_OPTIONS)


def name_check(value, field: str = "name") -> str:
    if not isinstance(value, str) or not re.fullmatch(MODEL_NAME_PATTERN, value):
        raise Invalid(field, f"A model's name: lowercase letters, digits and '-', at most {MODEL_NAME_MAX}, starting "
                             f"and ending alphanumeric.")
    return value


def _whole(value, field: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        raise Invalid(field, f"{what}: a whole number, got {value!r}.")
    return value


def _metrics_at(job: Job, step: int) -> dict:
    """The job's reported metrics at the checkpoint's step (the newest attempt's), else the last before it."""
    row = (JobMetric.objects.filter(job=job, step__lte=step).order_by("-step", "-attempt")
           .values("step", "loss", "samples_per_s").first())
    return dict(row) if row else {}


def lineage_of(job: Job, checkpoint) -> dict:
    """What a version records of where it came from, copied now so it outlives the job."""
    spec = job.spec
    return {
        "job": {"id": job.id, "name": job.name, "template": spec.get("template", ""),
                "environment": job.environment.name},
        "step": checkpoint.step,
        "checkpoint_uri": checkpoint.uri,
        "bundle": job.bundle.sha256 if job.bundle_id else None,
        "datasets": [{"name": d.get("name"), "version": d.get("version")} for d in spec.get("datasets") or []
                     if isinstance(d, dict)],
        "hyperparameters": spec.get("hyperparameters") or {},
        "metrics": _metrics_at(job, checkpoint.step),
    }


class NotDurable(Conflict):
    """The checkpoint is on the cluster's claim, where the portal does not read it, and not yet durable in the
    checkpoint store (the pod's upload is still pending, or failed): promote it once it is."""


# A blob stored by a promotion that is not yet named by a version's row, and the sweep that deletes unnamed
# blobs, take turns through this advisory lock (pg_advisory_xact_lock(class, 0)): the sweep holds it
# exclusively while it lists what is named and deletes the rest, a promotion holds it shared while it makes
# sure its blob is there and writes the row. A blob the sweep deleted between a promotion's copy and its row
# is stored again from the promotion's spool before the row is written.
WEIGHTS_LOCK = 35_101
GZIP_MAGIC = b"\x1f\x8b"


def _weights_lock(*, shared: bool) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT pg_advisory_xact_lock{'_shared' if shared else ''}(%s, 0)", [WEIGHTS_LOCK])


def _spool_blocks(blocks, spool) -> str:
    digest = hashlib.sha256()
    for block in blocks:
        digest.update(block)
        spool.write(block)
    spool.flush()
    return digest.hexdigest()


def _spool_checkpoint(job: Job, checkpoint: Checkpoint, spool) -> tuple[str, str]:
    """Copy the checkpoint's bytes into ``spool``: (sha256, format).

    A folder its job's folder still holds is copied as the .tar.gz the backend makes of it. Anything else is read
    with ``checkpoint_store.checkpoint_bytes``: the job folder's file, else the checkpoint store's copy (Kubernetes,
    whose claim the portal never reads, or a file pruned since it was stored). The store keeps a folder as that
    same .tar.gz, so a store copy that is a gzip stream is a folder's. NotDurable when only the store could have it
    and it is not durable there yet; Invalid naming ``step`` when the checkpoint is gone; Conflict when the cluster
    cannot be read now."""
    elsewhere = unavailable = None
    opened = None
    if checkpoint.deleted_at is None:
        try:
            opened = get_backend().job_checkpoint(job.id, job.environment.namespace, checkpoint.uri)
        except CheckpointElsewhere as exc:
            elsewhere = exc
        except CheckpointGone:
            pass
        except BackendError as exc:
            unavailable = exc
    if opened is not None and opened.is_folder:
        try:
            return _spool_blocks(opened.chunks, spool), WeightsFormat.TAR_GZ
        finally:
            opened.close()
    if opened is not None:
        opened.close()  # checkpoint_bytes opens the same file again, or the store's copy if it went meanwhile
    try:
        stream = checkpoint_store.checkpoint_bytes(checkpoint)
    except checkpoint_store.StoreRefused:
        if elsewhere is not None:
            state = checkpoint.store_state or "never asked for"
            raise NotDurable(
                f"Job {job.name} #{job.id}'s checkpoint of step {checkpoint.step} is on the cluster's volume claim, "
                f"which the portal does not read, and not yet durable in the checkpoint store (its store state: "
                f"{state}{': ' + checkpoint.store_reason if checkpoint.store_reason else ''}). Promote it once the "
                f"job's checkpoints API shows it durable.") from None
        if unavailable is not None:
            raise Conflict(f"The cluster cannot be read now ({unavailable}), and the checkpoint store has no "
                           f"durable copy of step {checkpoint.step}; try again.") from None
        raise Invalid("step", job_selectors.checkpoint_missing_text(
            job, checkpoint.step, f"deleted its checkpoint of step {checkpoint.step}")) from None
    try:
        first = stream.read(COPY_CHUNK)
        from_store = opened is None
        format_ = (WeightsFormat.TAR_GZ if from_store and first.startswith(GZIP_MAGIC) else WeightsFormat.FILE)
        sha256 = _spool_blocks(itertools.chain([first], iter(lambda: stream.read(COPY_CHUNK), b"")), spool)
    finally:
        stream.close()
    return sha256, format_


def _lock_name(tenant: Tenant, name: str) -> None:
    """Promotions of one tenant's model take turns numbering their versions (a transaction-level advisory lock)."""
    key = int.from_bytes(hashlib.sha256(f"model:{tenant.id}:{name}".encode()).digest()[:8], "big", signed=True)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [key])


def model_promote(*, actor: AbstractBaseUser, tenant: Tenant, data) -> tuple[ModelVersion, bool]:
    """Promote a checkpoint of one of the tenant's training jobs: {"name", "job", "step"} (step: the job's newest
    checkpoint when left out). (a new version numbered after the model's newest, True), or (the version that already
    holds this very checkpoint, False)."""
    require_role(user=actor, tenant=tenant, at_least=Role.MEMBER)
    if not isinstance(data, dict):
        raise Invalid("non_field_errors", 'A JSON object: {"name": "<model>", "job": <id>, "step": <n>}.')
    unknown = sorted(set(data) - set(PROMOTE_FIELDS))
    if unknown:
        raise Invalid(unknown[0], "Unknown field; promote takes name, job and step.")
    for field in ("name", "job"):
        if field not in data:
            raise Invalid(field, "This field is required.")
    name = name_check(data["name"])
    job_id = _whole(data["job"], "job", "A training job's id")
    job = Job.objects.filter(id=job_id, tenant=tenant, kind=Job.Kind.TRAINING).select_related(
        "environment", "bundle").first()
    if job is None:
        raise Invalid("job", f"Tenant {tenant.slug} has no training job {job_id}.")
    if "step" in data:
        step = _whole(data["step"], "step", "A checkpoint's step")
    else:
        newest = job.checkpoints.filter(deleted_at__isnull=True).order_by("-step").first()
        if newest is None:
            raise Invalid("job", job_selectors.checkpoint_missing_text(job, 0, "has no checkpoint to promote"))
        step = newest.step
    return promote_checkpoint(actor=actor, job=job, step=step, name=name)


def promote_checkpoint(*, actor: AbstractBaseUser, job: Job, step: int, name: str) -> tuple[ModelVersion, bool]:
    """Copy the job's checkpoint of ``step`` into the store and record it as a version of ``name`` (the caller has
    checked the actor's role and that the job is the tenant's). Invalid naming ``step`` when the checkpoint is gone,
    NotDurable (409) when it is on the cluster and not yet durable in the checkpoint store, Conflict when the
    cluster cannot be read now."""
    checkpoint = job.checkpoints.filter(step=step).first() if 0 <= step < 2**31 else None
    if checkpoint is None:
        raise Invalid("step", job_selectors.checkpoint_missing_text(job, step, f"has no checkpoint of step {step}"))
    store = weights_store()
    with tempfile.NamedTemporaryFile(prefix="promote-", suffix=".weights") as spool:
        sha256, format_ = _spool_checkpoint(job, checkpoint, spool)
        sha256, size = store.put_file(spool.name, sha256=sha256)
        lineage = lineage_of(job, checkpoint)
        with transaction.atomic():
            _weights_lock(shared=True)
            if not store.exists(sha256):  # the sweep took it between the copy and now
                store.put_file(spool.name, sha256=sha256)
            _lock_name(job.tenant, name)
            same = ModelVersion.objects.kept().filter(tenant=job.tenant, name=name, source_job=job, step=step,
                                                      weights_sha256=sha256).order_by("-version").first()
            if same is not None:
                return same, False
            # Numbers are never given twice: a deleted version's number stays its own.
            newest = ModelVersion.objects.filter(tenant=job.tenant, name=name).aggregate(
                newest=Max("version"))["newest"]
            version = ModelVersion.objects.create(
                tenant=job.tenant, name=name, version=(newest or 0) + 1, weights_sha256=sha256, weights_bytes=size,
                weights_format=format_, source_job=job, step=step, template=job.spec.get("template", ""),
                lineage=lineage, created_by=actor if getattr(actor, "pk", None) else None,
            )
            record("model.promoted", actor=actor, tenant=job.tenant, obj=version, object_repr=str(version),
                   after={"name": name, "version": version.version, "job": job.id, "step": step, "weights": sha256,
                          "bytes": size})
    logger.info("Promoted job %s step %s to model %s/%s v%s (%s bytes)", job.id, step, job.tenant.slug, name,
                version.version, size)
    return version, True


def model_version_delete(*, actor: AbstractBaseUser, tenant: Tenant, name: str, version) -> ModelVersion:
    """Delete a version (soft: it leaves every read and its number is never given again; its weights go with the next
    sweep unless another kept version names them). Conflict naming the endpoints while any serves it: an endpoint
    that serves it now, or a replica of one still running it (a rollout in progress)."""
    require_role(user=actor, tenant=tenant, at_least=Role.ADMIN)
    found = registry_selectors.tenant_version_get(tenant=tenant, name=name, version=version)
    with transaction.atomic():
        # The row's lock: a deploy or rollout that names the version locks it too, so it either sees it
        # deleted or is among the users asked about here.
        locked = ModelVersion.objects.select_for_update().filter(id=found.id, deleted_at__isnull=True).first()
        if locked is None:
            raise NotFound(f"version: model {name} version {found.version} was deleted meanwhile.")
        users = signals.users_of(locked)
        if users:
            raise Conflict(f"Model {name} version {locked.version} is served by {', '.join(users)}; roll "
                           f"{'it' if len(users) == 1 else 'them'} out to another version or delete "
                           f"{'it' if len(users) == 1 else 'them'} first.")
        now = timezone.now()
        ModelVersion.objects.filter(id=locked.id).update(
            deleted_at=now, deleted_by=actor if getattr(actor, "pk", None) else None)
        locked.deleted_at = now
        record("model.deleted", actor=actor, tenant=tenant, obj=locked, object_repr=str(locked),
               before={"name": name, "version": locked.version, "weights": locked.weights_sha256})
        transaction.on_commit(lambda: send_task(SWEEP_TASK))
    logger.info("Deleted model %s/%s v%s", tenant.slug, name, locked.version)
    return locked


SWEEP_TASK = "runners.registry.tasks.model_weights_sweep"


def weights_sweep() -> dict:
    """Delete every "models" blob that no kept version names; {"kept", "deleted", "deleted_bytes"}.

    Holds the weights lock exclusively while it lists what is named and deletes the rest, so a promotion's blob
    is never taken between its copy and its row (see WEIGHTS_LOCK). A blob a deleted version and a kept one share
    stays."""
    store = weights_store()
    deleted = freed = 0
    with transaction.atomic():
        _weights_lock(shared=False)
        named = set(ModelVersion.objects.kept().values_list("weights_sha256", flat=True))
        for sha256 in list(store.keys()):
            if sha256 in named:
                continue
            try:
                size = store.size(sha256)
                store.delete(sha256)
            except BlobMissing:
                continue
            deleted += 1
            freed += size
    if deleted:
        logger.info("Model weights sweep: deleted %s blobs no kept version names (%s bytes)", deleted, freed)
    return {"kept": len(named), "deleted": deleted, "deleted_bytes": freed}
