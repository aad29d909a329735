"""Code bundles: a team's project folder, uploaded as a .tar.gz and kept once per tenant under its digest.

The archive itself lies in the bundle storage (BUNDLE_STORAGE_URL, a folder or an S3 bucket), at
``<tenant slug>/<sha256>.tar.gz``; this row says it is there and what it holds. The row is written only
once the archive is stored, so a row always has its archive.

A deleted bundle keeps its row with ``deleted_at`` set (its archive is removed): the usage ledger
charges its storage up to that moment, and jobs that ran it still name it. The same folder uploaded
again after a delete is a new row.
"""

from django.conf import settings
from django.db import models
from django.db.models import Q


class Bundle(models.Model):
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="bundles")
    # The content digest (gpuportal.bundle.digest): the same files give the same digest however packed.
    sha256 = models.CharField(max_length=64)
    size_bytes = models.BigIntegerField(help_text="The stored archive's size (what storage is charged for).")
    unpacked_bytes = models.BigIntegerField(help_text="The files' total size once unpacked.")
    files = models.IntegerField(help_text="How many files it holds.")
    has_requirements = models.BooleanField(default=False, help_text="Whether it holds a top-level requirements.txt.")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "sha256"], condition=Q(deleted_at__isnull=True),
                                    name="one_kept_bundle_per_tenant_and_digest"),
            models.CheckConstraint(condition=Q(sha256__regex=r"^[0-9a-f]{64}$"), name="bundle_sha256_is_hex"),
        ]
        indexes = [models.Index(fields=["tenant", "-created_at"], name="bundle_tenant_newest")]
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.sha256[:12]}"
