"""What the GPUs did and what it cost: utilization samples, the usage ledger, budgets and reference prices.

This app sits above the apps whose work it meters (jobs, inference endpoints, the scheduling
cycle) and listens to their signals; nothing below imports it.
"""

from decimal import Decimal

from django.core.validators import MinValueValidator
from django.db import models


class Resolution(models.TextChoices):
    RAW = "raw"  # as read, every USAGE_SAMPLE_INTERVAL_S
    FIVE_MINUTES = "5m"  # raw samples older than USAGE_RAW_RETENTION_DAYS, averaged per 5 minutes
    HOUR = "1h"  # 5-minute samples older than USAGE_5M_RETENTION_DAYS, averaged per hour


class Source(models.TextChoices):
    NVML = "nvml"
    DCGM = "dcgm"
    SIMULATED = "simulated"  # the workload's own measured activity on a GPU the demo cluster simulates


class UtilizationSample(models.Model):
    """One device of one replica of an attempt, at one moment (or averaged over a bucket once downsampled)."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="+")
    attempt = models.PositiveSmallIntegerField()
    rank = models.PositiveSmallIntegerField()
    device = models.CharField(max_length=200)
    at = models.DateTimeField()
    resolution = models.CharField(max_length=3, choices=Resolution.choices, default=Resolution.RAW)
    source = models.CharField(max_length=10, choices=Source.choices)
    gpu_util_pct = models.FloatField(null=True)
    memory_used_mib = models.FloatField(null=True)
    power_w = models.FloatField(null=True)
    # How many raw readings a downsampled row averages (1 for a raw one).
    readings = models.PositiveIntegerField(default=1)

    class Meta:
        indexes = [
            models.Index(fields=["job", "at"], name="usage_sample_job_at"),
            models.Index(fields=["tenant", "at"], name="usage_sample_tenant_at"),
            models.Index(fields=["resolution", "at"], name="usage_sample_resolution_at"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["job", "attempt", "rank", "device", "resolution", "at"], name="one_sample_per_device_and_moment"
            ),
        ]


class EntryKind(models.TextChoices):
    GPU = "gpu"  # an attempt's allocation: its GPU units for as long as it held them
    STORAGE = "storage"  # a checkpoint kept, per GB-month


class UsageEntry(models.Model):
    """One line of the ledger: a piece of an attempt (or a checkpoint's keeping) within one day and one price.

    Append-only: when what was counted changes (an attempt found to have ended later than first
    recorded, a checkpoint's deletion learnt late), a correction is a new entry with the
    difference, never an edit. An entry's key says what it counts; the entries of one key sum to
    the truth.
    """

    kind = models.CharField(max_length=10, choices=EntryKind.choices)
    item = models.CharField(max_length=60)  # what is metered: "attempt:<id>" or "checkpoint:<id>"
    piece = models.CharField(max_length=40)  # which part of it: "<day>/<price card id or ->"
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    flavor = models.ForeignKey("quotas.ResourceFlavor", null=True, on_delete=models.PROTECT, related_name="+")
    job = models.ForeignKey("jobs.Job", null=True, on_delete=models.SET_NULL, related_name="+")
    endpoint = models.ForeignKey("inference.InferenceEndpoint", null=True, on_delete=models.SET_NULL, related_name="+")
    day = models.DateField()
    # GPU units x seconds held (kind gpu); byte-seconds / 1e9 / 3600 is not kept: storage keeps gb_seconds.
    gpu_seconds = models.DecimalField(max_digits=20, decimal_places=3, default=Decimal("0"))
    gb_seconds = models.DecimalField(max_digits=24, decimal_places=3, default=Decimal("0"))
    price_card = models.ForeignKey("quotas.PriceCard", null=True, on_delete=models.PROTECT, related_name="+")
    cost = models.DecimalField(max_digits=20, decimal_places=6)
    currency = models.CharField(max_length=3)
    # The same GPU-hours at the flavor's cloud reference price in force when the piece began.
    cloud_cost = models.DecimalField(max_digits=20, decimal_places=6, null=True)
    correction = models.BooleanField(default=False)
    recorded_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [
            models.Index(fields=["day", "tenant"], name="usage_entry_day_tenant"),
            models.Index(fields=["item"], name="usage_entry_item"),
            models.Index(fields=["job"], name="usage_entry_job"),
        ]


class Settlement(models.Model):
    """How far the ledger has counted one attempt or one checkpoint, so a sweep finds what changed."""

    kind = models.CharField(max_length=10)  # "attempt" or "checkpoint"
    object_id = models.BigIntegerField()
    # Counted through this moment: the item's end once it has ended (closed), else the last midnight
    # the sweep reached; what is still running is added up to now when asked, never written early.
    upto = models.DateTimeField()
    closed = models.BooleanField(default=False)
    settled_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["kind", "object_id"], name="one_settlement_per_item")]


class CapacityChange(models.Model):
    """A flavor's schedulable capacity from a moment on: the cluster's idle line integrates it."""

    flavor = models.ForeignKey("quotas.ResourceFlavor", on_delete=models.CASCADE, related_name="+")
    capacity = models.PositiveIntegerField()
    at = models.DateTimeField()

    class Meta:
        ordering = ["flavor", "at"]
        indexes = [models.Index(fields=["flavor", "at"], name="usage_capacity_flavor_at")]


class CloudPrice(models.Model):
    """What one flavor's unit-hour would cost at a cloud provider, from a date on: the reference beside every cost."""

    flavor = models.ForeignKey("quotas.ResourceFlavor", on_delete=models.CASCADE, related_name="+")
    price_per_hour = models.DecimalField(max_digits=10, decimal_places=4, validators=[MinValueValidator(Decimal("0"))])
    currency = models.CharField(max_length=3, default="USD")
    provider = models.CharField(max_length=60, blank=True, help_text="Where the reference comes from, e.g. an on-demand list price.")
    effective_from = models.DateTimeField()

    class Meta:
        ordering = ["flavor", "-effective_from"]
        constraints = [models.UniqueConstraint(fields=["flavor", "effective_from"], name="one_cloud_price_per_flavor_and_start")]


class Budget(models.Model):
    """A tenant's monthly budget: alerts at 80% and 100%, and optionally no borrowed work past it."""

    tenant = models.OneToOneField("tenants.Tenant", on_delete=models.CASCADE, related_name="budget")
    monthly_amount = models.DecimalField(max_digits=14, decimal_places=2, validators=[MinValueValidator(Decimal("0"))])
    currency = models.CharField(max_length=3, default="USD")
    stop_borrowing = models.BooleanField(
        default=False, help_text="Past the budget, admit only work within the tenant's guarantee."
    )
    updated_at = models.DateTimeField(auto_now=True)


class BudgetAlert(models.Model):
    """A threshold a tenant's month crossed: mailed once, shown as a banner, listed in the API."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    month = models.DateField()  # the first day of the month
    threshold = models.PositiveSmallIntegerField()  # 80 or 100 (percent)
    spent = models.DecimalField(max_digits=14, decimal_places=2)
    budget = models.DecimalField(max_digits=14, decimal_places=2)
    currency = models.CharField(max_length=3)
    at = models.DateTimeField(auto_now_add=True)
    mailed_to = models.JSONField(default=list)

    class Meta:
        ordering = ["-at"]
        constraints = [models.UniqueConstraint(fields=["tenant", "month", "threshold"], name="one_alert_per_threshold_and_month")]
