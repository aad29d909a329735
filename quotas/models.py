"""How much: resource flavors, prices, partition profiles, quotas."""

from decimal import Decimal

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models

from runners.models import NodePool, PartitionKind


class ResourceFlavor(models.Model):
    """A kind of GPU capacity a tenant can be granted: a whole GPU, a MIG slice or a time-slice share."""

    name = models.CharField(max_length=63, unique=True)
    kind = models.CharField(max_length=10, choices=PartitionKind.choices)
    gpu_model = models.CharField(max_length=40)
    mig_profile = models.CharField(max_length=20, blank=True)
    description = models.CharField(max_length=200, blank=True)
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


class PartitionProfile(models.Model):
    """A named way to cut every GPU of one model: whole, a MIG layout, or time-slicing replicas."""

    name = models.CharField(max_length=63, unique=True)
    gpu_model = models.CharField(max_length=40)
    kind = models.CharField(max_length=10, choices=PartitionKind.choices)
    # MIG profile names for one GPU, e.g. ["4g.40gb", "3g.40gb"]; empty unless kind is mig.
    layout = models.JSONField(default=list, blank=True)
    replicas = models.PositiveSmallIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["gpu_model", "name"]

    def __str__(self) -> str:
        return self.name


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


class PartitionChange(models.Model):
    """One application of a partition profile to a node pool, with its progress."""

    class State(models.TextChoices):
        PENDING = "pending"
        CORDONING = "cordoning"
        DRAINING = "draining"
        RELABELING = "relabeling"
        WAITING = "waiting"
        UNCORDONING = "uncordoning"
        SUCCEEDED = "succeeded"
        REFUSED = "refused"
        FAILED = "failed"

    class Drain(models.TextChoices):
        WAIT = "wait"
        PREEMPT = "preempt"

    FINISHED = (State.SUCCEEDED, State.REFUSED, State.FAILED)

    pool = models.ForeignKey(NodePool, on_delete=models.CASCADE, related_name="partition_changes")
    profile = models.ForeignKey(PartitionProfile, on_delete=models.PROTECT, related_name="changes")
    drain = models.CharField(max_length=10, choices=Drain.choices, default=Drain.WAIT)
    state = models.CharField(max_length=20, choices=State.choices, default=State.PENDING)
    message = models.CharField(max_length=1000, blank=True)
    # [{"at": iso time, "node": name or "", "step": state, "message": text}, ...]
    steps = models.JSONField(default=list, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # The worker running the change renews this while it works; a redelivered copy of
    # the task leaves a live lease alone, and the sweep resumes a change whose lease ran out.
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    # Nodes an operator had cordoned before the change began; the change leaves them cordoned.
    kept_cordoned = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            # One change in flight per pool: two would fight over the same labels.
            models.UniqueConstraint(
                fields=["pool"],
                condition=~models.Q(state__in=["succeeded", "refused", "failed"]),
                name="one_partition_change_in_flight_per_pool",
            )
        ]


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
