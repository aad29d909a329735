"""The audit log: who changed what, when, and how it was before and after. Rows are only ever added.

Every change a service makes to tenants, members, quotas, flavors, prices, partitions, tokens,
environments, jobs and endpoints adds one entry, in the same transaction as the change
(audit.services.record). Nothing edits or deletes an entry: the model and its queryset refuse it,
and a trigger in the database (migrations 0001, 0002) refuses an UPDATE, DELETE or TRUNCATE from
anywhere else. The portal runs as a role that does not own the table (DATABASE_APP_ROLE), so it
cannot turn the trigger off; each entry carries the hash of the one before it (audit.chain), so
`manage.py audit_verify` finds an entry missing, changed or forged.

The actor and the tenant are kept twice: as a key (to filter by) and as a name written down when
the entry was made. The keys carry no database constraint and nothing cascades along them, so
deleting a user or a tenant leaves its entries exactly as they were (a cascade or SET_NULL would
be a DELETE or an UPDATE, which the trigger refuses).
"""

from django.conf import settings
from django.db import models
from django.utils import timezone


class AppendOnlyError(Exception):
    """An attempt to change or delete an audit entry."""


APPEND_ONLY_MESSAGE = "Audit entries are append-only: they are never changed or deleted."


class AuditEntryQuerySet(models.QuerySet):
    def update(self, **kwargs):
        raise AppendOnlyError(APPEND_ONLY_MESSAGE)

    def delete(self):
        raise AppendOnlyError(APPEND_ONLY_MESSAGE)

    def bulk_update(self, objs, fields, batch_size=None):
        raise AppendOnlyError(APPEND_ONLY_MESSAGE)

    def update_or_create(self, defaults=None, create_defaults=None, **kwargs):
        raise AppendOnlyError(APPEND_ONLY_MESSAGE)

    def _raw_delete(self, using):
        raise AppendOnlyError(APPEND_ONLY_MESSAGE)


class AuditEntry(models.Model):
    at = models.DateTimeField(default=timezone.now)
    # The person who made the change; None for the portal's own work (the scheduler, a worker).
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.DO_NOTHING, db_constraint=False,
        related_name="+",
    )
    # Their username when the entry was made, or "scheduler" / "system" for the portal's own work.
    actor_name = models.CharField(max_length=150)
    tenant = models.ForeignKey(
        "tenants.Tenant", null=True, blank=True, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+",
    )
    tenant_slug = models.CharField(max_length=30, blank=True)
    action = models.CharField(max_length=64, help_text='What happened, as "<object>.<verb>": job.cancelled.')
    object_type = models.CharField(max_length=64, blank=True)
    object_id = models.CharField(max_length=64, blank=True)
    object_repr = models.CharField(max_length=200, blank=True)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    request_id = models.CharField(max_length=100, blank=True)
    # The hash chain (audit.chain): the previous entry's hash ("" for the first), and this entry's.
    prev_hash = models.CharField(max_length=64, blank=True, editable=False)
    hash = models.CharField(max_length=64, blank=True, editable=False)

    objects = AuditEntryQuerySet.as_manager()

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name_plural = "audit entries"
        indexes = [
            models.Index(fields=["tenant", "at"], name="audit_tenant_at"),
            models.Index(fields=["at"], name="audit_at"),
            models.Index(fields=["action", "at"], name="audit_action_at"),
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor_name} {self.action} {self.object_repr}".rstrip()

    def save(self, *args, **kwargs):
        if not self._state.adding:
            raise AppendOnlyError(APPEND_ONLY_MESSAGE)
        kwargs["force_insert"] = True
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise AppendOnlyError(APPEND_ONLY_MESSAGE)


class AuditChainHead(models.Model):
    """One row: the hash of the last entry appended. Appending locks it (audit.chain), so two transactions
    append one after the other; `audit_verify` finds entries removed from the log's end by it."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    hash = models.CharField(max_length=64, blank=True)

    def __str__(self) -> str:
        return self.hash or "(empty log)"
