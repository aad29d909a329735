"""The model registry's writes: promote a job's checkpoint to a new version of a named model.

Promotion copies the checkpoint's bytes into the content-addressed store (DATA_STORAGE_URL, kind "models")
before the version's row is written, so a row always has its weights, and the weights are the version's own:
the job's checkpoints may be collected and the job deleted afterwards, and the version still serves. The
copy is made with no lock held; only the numbering of the version takes the (tenant, name) lock.

Versions are immutable: nothing here changes one. Promoting the checkpoint a version of the same name
already holds (same job, step and bytes) answers that version again, so a deploy from a job's checkpoint,
repeated, does not mint a version each time.
"""

from __future__ import annotations

import hashlib
import logging
import re
import tempfile

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import connection, transaction
from django.db.models import Max

from audit.services import record
from common.errors import Conflict, Invalid
from runners.jobs import selectors as job_selectors
from runners.jobs.models import Job, JobMetric
from runners.registry.models import MODEL_NAME_MAX, MODEL_NAME_PATTERN, ModelVersion, WeightsFormat
from runners.storage.blobs import BlobStore
from tenants.models import Role, Tenant
from tenants.services import require_role

logger = logging.getLogger(__name__)

WEIGHTS_KIND = "models"
PROMOTE_FIELDS = ("name", "job", "step")
# Blocks of a checkpoint copied into the store at a time.
COPY_CHUNK = 1 << 20


class NotCopyable(Invalid):
    """The backend keeps the checkpoint where the portal does not read it (Kubernetes: on the cluster's claim)."""

    def __init__(self, message: str):
        super().__init__("step", message)


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


def _copy_to_store(opened) -> tuple[str, int, str]:
    """(sha256, bytes, format) of a checkpoint opened through the backend, once copied into the store."""
    with tempfile.NamedTemporaryFile(prefix="promote-", suffix=".weights") as spool:
        digest = hashlib.sha256()
        try:
            if opened.is_folder:
                blocks, format_ = opened.chunks, WeightsFormat.TAR_GZ
            else:
                blocks, format_ = iter(lambda: opened.stream.read(COPY_CHUNK), b""), WeightsFormat.FILE
            for block in blocks:
                digest.update(block)
                spool.write(block)
        finally:
            opened.close()
        spool.flush()
        sha256, size = weights_store().put_file(spool.name, sha256=digest.hexdigest())
    return sha256, size, format_


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
    checked the actor's role and that the job is the tenant's). Invalid naming ``step`` when the checkpoint cannot be
    read here (gone, or kept in the cluster), Conflict when the cluster cannot be read now."""
    try:
        checkpoint, opened = job_selectors.job_checkpoint_open(job, step)
    except job_selectors.CheckpointMissing as exc:
        raise Invalid("step", str(exc)) from None
    except job_selectors.CheckpointNotHere as exc:
        raise NotCopyable(f"The portal cannot copy this checkpoint into the model store: {exc}") from None
    except job_selectors.BackendUnavailable as exc:
        raise Conflict(str(exc)) from None
    sha256, size, format_ = _copy_to_store(opened)
    lineage = lineage_of(job, checkpoint)
    with transaction.atomic():
        _lock_name(job.tenant, name)
        same = ModelVersion.objects.filter(tenant=job.tenant, name=name, source_job=job, step=step,
                                           weights_sha256=sha256).order_by("-version").first()
        if same is not None:
            return same, False
        newest = ModelVersion.objects.filter(tenant=job.tenant, name=name).aggregate(newest=Max("version"))["newest"]
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
