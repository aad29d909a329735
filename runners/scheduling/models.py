"""The scheduling cycle's one row: its lock on databases without advisory locks, and its last figures."""

from django.db import models


class SchedulerCycle(models.Model):
    """The one row the scheduler cycle updates first: its lock on databases without advisory locks, and its figures."""

    runs = models.PositiveBigIntegerField(default=0)
    last_started_at = models.DateTimeField(null=True, blank=True)
    last_duration_ms = models.FloatField(default=0)
    last_admitted = models.PositiveIntegerField(default=0)
    last_preempted = models.PositiveIntegerField(default=0)
    last_waiting = models.PositiveIntegerField(default=0)

    class Meta:
        db_table = "runners_schedulercycle"  # the table kept its name when the model moved here
