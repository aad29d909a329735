"""Notifications: what each member wants mailed, a tenant's webhooks, the events sent and each delivery.

An ``Event`` is written once per thing that happened (its ``key`` says what: a job's terminal
state, one preempted attempt, one quota change), so a message delivered twice never notifies
twice. Each webhook subscribed to the event gets a ``Delivery``: the delivery log.
"""

from django.conf import settings
from django.db import models


class EventKind(models.TextChoices):
    JOB_FINISHED = "job_finished", "Job finished"
    JOB_FAILED = "job_failed", "Job failed"
    JOB_PREEMPTED = "job_preempted", "Job preempted"
    ENVIRONMENT_FAILED = "environment_failed", "Environment failed"
    QUOTA_CHANGED = "quota_changed", "Quota changed"
    # Told to its owner only: stopped by the idle cull, or preempted by another tenant's guarantee.
    WORKSPACE_STOPPED = "workspace_stopped", "Workspace stopped"


# What a member is mailed before choosing: failures and preemptions, not every finish or quota change.
EMAIL_DEFAULTS = {
    EventKind.JOB_FINISHED: False,
    EventKind.JOB_FAILED: True,
    EventKind.JOB_PREEMPTED: True,
    EventKind.ENVIRONMENT_FAILED: True,
    EventKind.QUOTA_CHANGED: False,
    EventKind.WORKSPACE_STOPPED: True,
}


class Preference(models.Model):
    """One member's choice for one kind of event in one tenant; without a row the default holds."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notification_preferences")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="notification_preferences")
    event = models.CharField(max_length=30, choices=EventKind.choices)
    email = models.BooleanField()
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "tenant", "event"], name="one_preference_per_user_tenant_event"),
        ]
        ordering = ["tenant__slug", "user__username", "event"]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant}: {self.event} email={'on' if self.email else 'off'}"


class Webhook(models.Model):
    """A URL of the tenant's that is POSTed every event it subscribes to, signed with its secret."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="webhooks")
    url = models.URLField(max_length=500)
    # Made by the portal; the HMAC key of every delivery, so it is kept as is (never hashed).
    secret = models.CharField(max_length=64)
    events = models.JSONField(default=list)
    active = models.BooleanField(default=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant__slug", "id"]

    def __str__(self) -> str:
        return f"{self.tenant.slug}: {self.url}"


class Event(models.Model):
    """Something that happened in a tenant, recorded once under its key, with the payload sent for it."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="notification_events")
    kind = models.CharField(max_length=30, choices=EventKind.choices)
    # "job:12:succeeded", "attempt:40:preempted", "environment:3:failed", "quota:<uuid>".
    key = models.CharField(max_length=100, unique=True)
    payload = models.JSONField()
    occurred_at = models.DateTimeField()
    # Set when the mail was sent (or given up after MAIL_MAX_ATTEMPTS): mail goes once per event. A try
    # claims it until email_claimed_until (NOTIFY_MAIL_CLAIM_S on): a worker that dies mid-mail lets go
    # when it runs out. A try that fails lets go at once (the sweep tries again); the last failure is kept.
    emailed_at = models.DateTimeField(null=True, blank=True)
    email_claimed_until = models.DateTimeField(null=True, blank=True)
    email_attempts = models.PositiveSmallIntegerField(default=0)
    email_error = models.CharField(max_length=1000, blank=True)
    # How often the sweep sent its mail's message again, and not before when it sends it next.
    sweeps = models.PositiveSmallIntegerField(default=0)
    sweep_after = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        # The sweep's look for mail still to go: a few rows, whatever the number of events.
        indexes = [models.Index(fields=["created_at"], name="event_unmailed", condition=models.Q(emailed_at__isnull=True))]

    def __str__(self) -> str:
        return self.key


class Outbox(models.Model):
    """What a signal announced, written in the signal's own transaction: nothing is lost to a broker
    that is down at commit or a worker that dies mid-task, since the row stays until processed (by
    its task, or by the sweep once it has waited a while)."""

    # "jobs" (ref: a list of job ids), "environment" (an environment id), "quota" (a tenant id, with the
    # change's key and time).
    source = models.CharField(max_length=20)
    ref = models.JSONField()
    key = models.CharField(max_length=100, blank=True)
    at = models.CharField(max_length=40, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    processed_at = models.DateTimeField(null=True, blank=True)
    # How often the sweep sent it again, and not before when it sends it next (its message may be queued).
    sweeps = models.PositiveSmallIntegerField(default=0)
    sweep_after = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["processed_at", "created_at"], name="outbox_unprocessed")]

    def __str__(self) -> str:
        return f"{self.source} {self.ref} ({'processed' if self.processed_at else 'pending'})"


class DeliveryState(models.TextChoices):
    PENDING = "pending"  # not delivered yet; next_try_at says when it is tried (again)
    DELIVERED = "delivered"  # the receiver answered 2xx
    FAILED = "failed"  # every attempt failed (NOTIFY_WEBHOOK_MAX_ATTEMPTS)


class Delivery(models.Model):
    """One event for one webhook: each attempt's answer is written here (the delivery log)."""

    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    event = models.ForeignKey(Event, on_delete=models.CASCADE, related_name="deliveries")
    kind = models.CharField(max_length=30, choices=EventKind.choices)
    payload = models.JSONField()
    state = models.CharField(max_length=10, choices=DeliveryState.choices, default=DeliveryState.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    next_try_at = models.DateTimeField(null=True, blank=True)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    error = models.CharField(max_length=1000, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    # How often the sweep sent it again since its last try, and not before when it sends it next.
    sweeps = models.PositiveSmallIntegerField(default=0)
    sweep_after = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [models.UniqueConstraint(fields=["webhook", "event"], name="one_delivery_per_webhook_event")]
        indexes = [models.Index(fields=["state", "next_try_at"], name="delivery_due")]

    def __str__(self) -> str:
        return f"{self.kind} -> webhook {self.webhook_id} ({self.state})"
