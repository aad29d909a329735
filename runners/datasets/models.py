"""Datasets: named per tenant, versioned, immutable once sealed; their files packed into shards.

A version's files are packed into WebDataset shards (POSIX tar files, the files of one sample sharing a
key, at most DATASET_SHARD_MAX_BYTES each), and each shard is a blob of kind "shards" in the content-addressed
store (runners.storage.blobs), keyed by its sha256: the same shard in two tenants' datasets is stored once.
Who may read a shard is decided here, by the rows that name it: a tenant reads the shards of its own
datasets' sealed versions and of the datasets shared with it.

A version is ``open`` while it is uploaded (its shards declared, their bytes received one by one, each
checked against its hash on receipt) and becomes ``sealed`` only once every declared shard is stored;
readers (lists, jobs, the SDK) see sealed versions only, so nothing is half-visible. A sealed version
never changes: no shard is added to it, none removed, its index stays. A version registered from a storage
URL is packed by a worker; it is ``failed`` (with the reason) when that could not be done.
"""

from django.conf import settings
from django.db import models
from django.db.models import Q

# Dataset names are slugs, like tenants' (a shared one is named "<owner>/<name>" by others).
NAME_MAX = 63
NAME_PATTERN = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"


class Dataset(models.Model):
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="datasets")
    name = models.CharField(max_length=NAME_MAX)
    description = models.CharField(max_length=500, blank=True, default="")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="one_dataset_per_tenant_and_name"),
            models.CheckConstraint(condition=Q(name__regex=rf"^{NAME_PATTERN}$"), name="dataset_name_is_a_slug"),
        ]
        ordering = ["tenant_id", "name"]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.name}"


class VersionState(models.TextChoices):
    OPEN = "open", "open (uploading)"
    SEALED = "sealed", "sealed"
    FAILED = "failed", "failed"


class DatasetVersion(models.Model):
    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    state = models.CharField(max_length=10, choices=VersionState.choices, default=VersionState.OPEN)
    reason = models.CharField(max_length=1000, blank=True, default="", help_text="Why a version failed.")
    # Where the files came from: "upload" (portal data push) or the storage URL it was registered from.
    source = models.CharField(max_length=1000, default="upload")
    # The client's digest of the shard list it pushes (sha256 of "<sha> <bytes>\n" per shard, in order):
    # a cut push that starts again finds its open version by it and resumes.
    manifest_sha256 = models.CharField(max_length=64, blank=True, default="")
    # Written at the seal, from the shard rows.
    shards = models.IntegerField(default=0)
    bytes = models.BigIntegerField(default=0, help_text="The shards' bytes.")
    samples = models.BigIntegerField(default=0)
    files = models.BigIntegerField(default=0)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    sealed_at = models.DateTimeField(null=True, blank=True)
    # An open version's last sign of life (opened or resumed, shards declared, a part received, a shard packed by
    # the registering worker): the sweep discards an upload and sends a registration again only a lease after it.
    touched_at = models.DateTimeField(null=True, blank=True)
    # How many times a registration was sent to a worker (the first send included); 0 for an upload.
    register_sends = models.PositiveSmallIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["dataset", "number"], name="one_dataset_version_per_number"),
            models.CheckConstraint(condition=Q(state="sealed", sealed_at__isnull=False) | ~Q(state="sealed"),
                                   name="a_sealed_version_says_when"),
        ]
        ordering = ["dataset_id", "-number"]

    def __str__(self) -> str:
        return f"{self.dataset}:{self.number}"


class VersionShard(models.Model):
    """One shard of a version, at its position; ``stored`` once its bytes were received and checked (or the
    tenant already held a shard of that hash)."""

    version = models.ForeignKey(DatasetVersion, on_delete=models.CASCADE, related_name="shard_rows")
    position = models.PositiveIntegerField()
    sha256 = models.CharField(max_length=64)
    bytes = models.BigIntegerField()
    samples = models.IntegerField(default=0)
    stored = models.BooleanField(default=False)
    # The shard's index, read from its own tar headers when it was stored: [[member name, bytes], ...].
    members = models.JSONField(default=list)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["version", "position"], name="one_shard_per_version_position"),
            models.CheckConstraint(condition=Q(sha256__regex=r"^[0-9a-f]{64}$"), name="shard_sha256_is_hex"),
        ]
        indexes = [models.Index(fields=["sha256"], name="version_shard_by_sha")]
        ordering = ["version_id", "position"]

    def __str__(self) -> str:
        return f"{self.version}#{self.position}"


class DatasetShare(models.Model):
    """The dataset is readable (never writable) by another tenant's members."""

    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="shares")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="datasets_shared_with")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["dataset", "tenant"], name="one_share_per_dataset_and_tenant")]


class DatasetUse(models.Model):
    """A job that names the version in its spec (written at submit; the job app is above this one, so the job
    is named by id). ``read_at`` is when the job's script said it opened the version."""

    version = models.ForeignKey(DatasetVersion, on_delete=models.CASCADE, related_name="uses")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    job_id = models.BigIntegerField()
    job_name = models.CharField(max_length=100)
    created_at = models.DateTimeField(auto_now_add=True)
    read_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["version", "job_id"], name="one_use_per_version_and_job")]
        indexes = [models.Index(fields=["job_id"], name="dataset_use_by_job")]
        ordering = ["-created_at", "-id"]
