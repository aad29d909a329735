"""How much: resource flavors (with the capacity the inventory reports for each), prices, quotas."""

from decimal import Decimal

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models

from runners.nvidia import names


class PartitionKind(models.TextChoices):
    """How a GPU is cut; the strings are runners.nvidia.names' one spelling."""

    WHOLE = names.WHOLE
    MIG = names.MIG
    TIMESLICE = names.TIMESLICE


class ResourceFlavor(models.Model):
    """A kind of GPU capacity a tenant can be granted: a whole GPU, a MIG slice or a time-slice share."""

    name = models.CharField(max_length=63, unique=True)
    kind = models.CharField(max_length=10, choices=PartitionKind.choices)
    gpu_model = models.CharField(max_length=40)
    mig_profile = models.CharField(max_length=20, blank=True)
    description = models.CharField(max_length=200, blank=True)
    # Units of this flavor the schedulable inventory holds now. Written by the inventory's owner
    # (runners: every inventory sync, cordon and uncordon) so quotas can check guarantees against it.
    capacity = models.PositiveIntegerField(default=0)
    capacity_updated_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["gpu_model", "kind", "mig_profile"]
        constraints = [
            models.UniqueConstraint(fields=["kind", "gpu_model", "mig_profile"], name="one_flavor_per_resource_shape")
        ]

    def __str__(self) -> str:
        return self.name


class PriceCard(models.Model):
    """The hourly price of one flavor from a date on; the newest card that has started applies."""

    flavor = models.ForeignKey(ResourceFlavor, on_delete=models.CASCADE, related_name="prices")
    price_per_hour = models.DecimalField(max_digits=10, decimal_places=4, validators=[MinValueValidator(Decimal("0"))])
    currency = models.CharField(max_length=3, default="USD")
    effective_from = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["flavor", "-effective_from"]
        constraints = [models.UniqueConstraint(fields=["flavor", "effective_from"], name="one_price_per_flavor_and_start")]


class Quota(models.Model):
    """A tenant's share of one flavor: guaranteed units, a burst ceiling, and scheduling weight."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="quotas")
    flavor = models.ForeignKey(ResourceFlavor, on_delete=models.PROTECT, related_name="quotas")
    guaranteed = models.PositiveIntegerField(default=0)
    max = models.PositiveIntegerField(default=0)
    fair_share_weight = models.DecimalField(max_digits=6, decimal_places=2, default=Decimal("1"))
    max_priority = models.PositiveSmallIntegerField(default=100)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["tenant__slug", "flavor__name"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "flavor"], name="one_quota_per_tenant_and_flavor"),
            models.CheckConstraint(condition=models.Q(guaranteed__lte=models.F("max")), name="guaranteed_within_max"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant.slug}: {self.flavor.name} {self.guaranteed}/{self.max}"


class GuaranteeReduction(models.Model):
    """A guarantee lowered because the capacity behind it shrank (a partition change), for the record."""

    quota = models.ForeignKey(Quota, null=True, on_delete=models.SET_NULL, related_name="reductions")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="guarantee_reductions")
    flavor = models.ForeignKey(ResourceFlavor, on_delete=models.CASCADE, related_name="guarantee_reductions")
    guaranteed_before = models.PositiveIntegerField()
    guaranteed_after = models.PositiveIntegerField()
    reason = models.CharField(max_length=500)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]


class BorrowingPause(models.Model):
    """A tenant whose borrowed (beyond-guarantee) work is not admitted for now, and why.

    Written by whatever decides it (a budget spent, by the usage app above); the scheduling cycle
    then treats each of the tenant's quotas as its guarantee. Work already running is left alone.
    """

    tenant = models.OneToOneField("tenants.Tenant", on_delete=models.CASCADE, related_name="borrowing_pause")
    reason = models.CharField(max_length=500)
    since = models.DateTimeField(auto_now_add=True)


class TenantStorage(models.Model):
    """A tenant's checkpoint storage: its quota in GB of the store's bytes after deduplication (None: no
    limit) and the retention policy its jobs' checkpoints follow unless a job's spec names its own (the JSON
    form of runners.storage.retention.RetentionPolicy; None keeps everything)."""

    tenant = models.OneToOneField("tenants.Tenant", on_delete=models.CASCADE, related_name="storage")
    quota_gb = models.DecimalField(max_digits=12, decimal_places=3, null=True, blank=True,
                                   validators=[MinValueValidator(Decimal("0"))])
    retention = models.JSONField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.tenant.slug}: {self.quota_gb if self.quota_gb is not None else 'no'} GB"
