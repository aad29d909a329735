"""The scheduling cycle's one row (its lock on databases without advisory locks, and its last figures), and the
moves it made to make room."""

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


class JobMove(models.Model):
    """One move the cycle made: a running job stopped with a checkpoint, to resume on another node, so that a job
    that fitted nowhere fits (runners.scheduling.defrag). The budget and the "never twice within a window" rule
    are counted from these rows."""

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="moves")
    for_job = models.ForeignKey("jobs.Job", null=True, on_delete=models.SET_NULL, related_name="+")
    flavor = models.CharField(max_length=100)
    from_node = models.CharField(max_length=253)
    to_node = models.CharField(max_length=253)
    units = models.PositiveIntegerField()
    # What the cycle expected the move to cost the job's units, in seconds (checkpoint, stop, restore).
    cost_s = models.FloatField()
    # What the move gained, in words: "4 whole H100-80GB on h100-node-1 for a 4-GPU job that fitted nowhere".
    gain = models.CharField(max_length=300)

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"job {self.job_id} {self.from_node} -> {self.to_node}"
