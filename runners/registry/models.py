"""The model registry: a tenant's named models, each a list of immutable versions promoted from checkpoints.

A version keeps its own copy of the weights (a blob of kind "models" in the content-addressed store,
``runners.storage.blobs``, copied at promotion) and its lineage (the job, its bundle, the datasets and
versions it read, its hyperparameters and the metrics at the checkpoint's step), so it outlives the job's
checkpoints being collected and the job itself being deleted: ``source_job`` then reads null and the
lineage still names the job.
"""

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from django.db.models import Q

MODEL_NAME_MAX = 40
MODEL_NAME_PATTERN = rf"[a-z0-9]([-a-z0-9]{{0,{MODEL_NAME_MAX - 2}}}[a-z0-9])?"
model_name_validator = RegexValidator(
    rf"^{MODEL_NAME_PATTERN}$",
    f"Lowercase letters, digits and '-', at most {MODEL_NAME_MAX}, starting and ending alphanumeric.",
)


class WeightsFormat(models.TextChoices):
    FILE = "file"  # one checkpoint file (what the shipped server loads)
    TAR_GZ = "tar.gz"  # a checkpoint folder, kept as a .tar.gz of its files


class ModelVersionQuerySet(models.QuerySet):
    def kept(self):
        """The versions not deleted."""
        return self.filter(deleted_at__isnull=True)


class ModelVersion(models.Model):
    """One version of a tenant's model: immutable once written (``save`` refuses an update); a delete only marks it."""

    objects = ModelVersionQuerySet.as_manager()

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="model_versions")
    name = models.CharField(max_length=MODEL_NAME_MAX, validators=[model_name_validator])
    version = models.PositiveIntegerField()
    # The weights: a blob of kind "models" in DATA_STORAGE_URL, named by its sha256.
    weights_sha256 = models.CharField(max_length=64)
    weights_bytes = models.PositiveBigIntegerField()
    weights_format = models.CharField(max_length=10, choices=WeightsFormat.choices, default=WeightsFormat.FILE)
    # Lineage. The job may be deleted later (null then); `lineage` keeps what was known at promotion:
    # {"job": {"id", "name", "template", "environment"}, "step", "checkpoint_uri", "bundle": sha256 or None,
    #  "datasets": [{"name", "version"}], "hyperparameters": {...},
    #  "metrics": {"step", "loss", "samples_per_s"} or {}}.
    source_job = models.ForeignKey("jobs.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    step = models.PositiveIntegerField()
    template = models.CharField(max_length=40, help_text="The source job's template: which server can load it.")
    lineage = models.JSONField(default=dict)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    # A delete is soft: the row stays (endpoints and replicas that served it keep naming it, and its number is
    # never given again), it leaves every read, and the weights sweep removes its blob once no kept version
    # names it. Written only by ``services.model_version_delete``, with an update of these two fields alone.
    deleted_at = models.DateTimeField(null=True, blank=True)
    deleted_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")

    class Meta:
        ordering = ["tenant_id", "name", "-version"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name", "version"], name="unique_model_version"),
            models.CheckConstraint(condition=Q(weights_sha256__regex=r"^[0-9a-f]{64}$"),
                                   name="model_weights_sha256_is_hex"),
            models.CheckConstraint(condition=Q(version__gte=1), name="model_version_from_one"),
        ]
        indexes = [models.Index(fields=["weights_sha256"], name="model_version_weights")]

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"

    def save(self, *args, **kwargs):
        if not self._state.adding:
            raise ValueError(f"Model version {self} is immutable: promote a new version instead of changing it.")
        super().save(*args, **kwargs)

    @property
    def source_job_name(self) -> str:
        return (self.lineage.get("job") or {}).get("name", "")

    @property
    def source_job_number(self) -> int | None:
        """The job's id as it was at promotion (kept when the job is deleted)."""
        return (self.lineage.get("job") or {}).get("id")
