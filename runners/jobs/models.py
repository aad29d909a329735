"""Training jobs: the validated spec, its attempts, checkpoints, metrics and events, and the reconcile's lease."""

from django.conf import settings
from django.db import models

from runners.environments.models import Environment
from tenants.models import dns_label_validator

# A new job's reason until the scheduler cycle first looks at it.
NOT_YET_SEEN_REASON = "Waiting for the scheduler."


class JobState(models.TextChoices):
    QUEUED = "queued"  # waiting for the scheduler cycle
    ADMITTED = "admitted"  # the cycle placed it; an attempt exists, a worker launches it
    LAUNCHING = "launching"  # a worker is starting its replicas
    RUNNING = "running"
    PREEMPTED = "preempted"  # told to checkpoint and stop; holds its GPUs until it has
    CANCELLING = "cancelling"  # a user cancelled it while it ran; stopping with the grace period
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


# Jobs in these states hold what their attempt was placed on.
JOB_HOLDING_STATES = [
    JobState.ADMITTED, JobState.LAUNCHING, JobState.RUNNING, JobState.PREEMPTED, JobState.CANCELLING
]
JOB_FINAL_STATES = [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED]


class AttemptOutcome(models.TextChoices):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    PREEMPTED = "preempted"
    NODE_LOST = "node_lost"
    CANCELLED = "cancelled"


class Job(models.Model):
    """A training job: the validated spec, where it stands, and why.

    State changes go through ``runners.jobs.services.transition`` only, which records each as a
    JobEvent with its reason.
    """

    class Kind(models.TextChoices):
        TRAINING = "training"
        # One replica of an inference endpoint (runners.inference): the server instead of the trainer,
        # scheduled, placed, preempted and reconciled like any other job.
        SERVING = "serving"
        # A member's interactive workspace (runners.workspaces): JupyterLab on its flavor until stopped.
        WORKSPACE = "workspace"

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="jobs")
    environment = models.ForeignKey(Environment, on_delete=models.PROTECT, related_name="jobs")
    name = models.CharField(max_length=63, validators=[dns_label_validator])
    kind = models.CharField(max_length=20, choices=Kind.choices, default=Kind.TRAINING)
    # The request as validated (the API's shape, tenant slug and environment id included).
    spec = models.JSONField()
    flavor = models.ForeignKey("quotas.ResourceFlavor", on_delete=models.PROTECT, related_name="jobs")
    # A script job's code (the spec names it by digest). Bundle rows are never removed, only marked deleted,
    # and a delete is refused while a job that is not over uses it (runners.jobs.services.jobs_using_bundle).
    bundle = models.ForeignKey("bundles.Bundle", null=True, blank=True, on_delete=models.PROTECT, related_name="jobs")
    replicas = models.PositiveSmallIntegerField()
    gpus_per_replica = models.PositiveSmallIntegerField()
    priority = models.PositiveSmallIntegerField(default=0)
    preemptible = models.BooleanField(default=True)
    state = models.CharField(max_length=20, choices=JobState.choices, default=JobState.QUEUED)
    reason = models.CharField(
        max_length=1000, blank=True,
        help_text="Why the job is where it is, in words; the time that goes with it is projected_start (queued) or "
                  "stop_deadline (preempted, cancelling).",
    )
    # Written by each scheduler cycle for queued jobs: 1 is next in line.
    queue_position = models.PositiveIntegerField(null=True, blank=True)
    # Written beside the reason by each cycle; a time, never in the reason's text, so each page
    # shows it in its reader's time zone.
    projected_start = models.DateTimeField(
        null=True, blank=True,
        help_text="When the scheduler expects this queued job to start, going by the estimated ends of the work "
                  "ahead of it; null when unknown or not queued.",
    )
    # Failed attempts so far (preemptions and lost nodes do not count).
    failures = models.PositiveSmallIntegerField(default=0)
    # Set when the job is told to stop (preemption or cancel); after it, the backend kills.
    stop_deadline = models.DateTimeField(
        null=True, blank=True,
        help_text="While the job is preempted or cancelling: when it is stopped if it has not stopped by itself.",
    )
    submitted_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    submitted_at = models.DateTimeField(auto_now_add=True)
    state_changed_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # The reconcile's bookkeeping: after an error on this job it waits until reconcile_after
    # (backoff doubling with reconcile_errors) while the other jobs go on.
    reconcile_errors = models.PositiveIntegerField(default=0)
    reconcile_after = models.DateTimeField(null=True, blank=True)
    reconcile_error = models.CharField(max_length=1000, blank=True)
    # Where the last read of the job's progress (metrics, checkpoints) stopped: the backend's own cursor.
    progress_cursor = models.JSONField(default=dict, blank=True)
    # A place the scheduler keeps for the job's next attempt (replicas as JobAttempt.placement has them), until
    # pinned_until: set on a job moved to make room (its new place) and on the job the room is made for
    # (runners.scheduling.defrag). While it holds, nobody else is placed there and the job is admitted there.
    pinned_placement = models.JSONField(null=True, blank=True)
    pinned_until = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "runners_job"  # the table kept its name when the model moved here
        ordering = ["-submitted_at", "-id"]
        indexes = [
            models.Index(fields=["state", "priority"], name="job_state_priority"),
            models.Index(fields=["tenant", "state"], name="job_tenant_state"),
            # The API's job list: a tenant's newest first, a page read off the index instead of sorting them all.
            models.Index(fields=["tenant", "-submitted_at", "-id"], name="job_tenant_newest"),
            # The scheduler cycle learns a flavor's typical pods from its latest submissions.
            models.Index(fields=["flavor", "-submitted_at", "-id"], name="job_flavor_newest"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.name}#{self.id}"

    @property
    def units(self) -> int:
        return self.replicas * self.gpus_per_replica


class AttemptQuerySet(models.QuerySet):
    def open(self) -> "AttemptQuerySet":
        """Attempts not ended yet: each holds what it was placed on (the ownership rule's one query)."""
        return self.filter(ended_at__isnull=True)


class JobAttempt(models.Model):
    """One launch of a job: where each replica was placed, and how it ended."""

    objects = AttemptQuerySet.as_manager()

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveSmallIntegerField()
    # [{"replica": 0, "node": "h100-node-1", "gpus": [0, 1]}, ...]; a MIG slice is
    # {"gpus": [3], "mig_profile": "3g.40gb", "mig_start": 4}.
    placement = models.JSONField(default=list)
    admitted_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=20, choices=AttemptOutcome.choices, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    reason = models.CharField(max_length=1000, blank=True)
    resumed_from_step = models.PositiveIntegerField(null=True, blank=True)
    # The launch lease: the worker launching this attempt (its token) holds it until
    # launch_lease_until, renewing it while the backend call runs. Nobody else ends or
    # relaunches an attempt whose lease is live; see runners.jobs.attempts for the whole rule.
    launch_token = models.CharField(max_length=36, blank=True)
    launch_lease_until = models.DateTimeField(null=True, blank=True)
    # When its trainer finished its first step: max_runtime_s is counted from here.
    first_step_at = models.DateTimeField(null=True, blank=True)
    # When the portal read the stop record its rank 0 wrote (the SDK's, once the script saw should_stop()):
    # the script checkpointed on the portal's request, so ranks exiting 0 count as the trainer's 75 does.
    stop_recorded_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "runners_jobattempt"  # the table kept its name when the model moved here
        ordering = ["job_id", "number"]
        constraints = [models.UniqueConstraint(fields=["job", "number"], name="unique_attempt_number")]

    def __str__(self) -> str:
        return f"{self.job_id}/{self.number}"


class CheckpointQuerySet(models.QuerySet):
    def newest_first(self) -> "CheckpointQuerySet":
        return self.order_by("-step")


class Checkpoint(models.Model):
    """A checkpoint a job wrote: resuming starts from the newest."""

    objects = CheckpointQuerySet.as_manager()

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="checkpoints")
    attempt = models.ForeignKey(JobAttempt, null=True, on_delete=models.SET_NULL, related_name="checkpoints")
    step = models.PositiveIntegerField()
    uri = models.CharField(max_length=1000)
    bytes = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField()
    # When its file went: the shipped trainer keeps its newest few and deletes the rest as it writes
    # new ones (recorded by the progress reader); None while it is kept. Storage is metered until then.
    deleted_at = models.DateTimeField(null=True, blank=True)
    # Its copy in the checkpoint store (runners.jobs.checkpoint_store): "" never asked for (a backend whose
    # files the portal cannot read, or written before the store), pending, storing (its chunks' bytes
    # reserved against the tenant's storage quota), durable (every chunk stored: a resume or a promotion may
    # read it from the store), failed (store_reason says why), discarded (deleted by retention), skipped
    # (superseded by a newer pending checkpoint while the store was behind, and not one retention keeps).
    store_state = models.CharField(max_length=10, blank=True, default="")
    store_reason = models.CharField(max_length=500, blank=True)
    durable_at = models.DateTimeField(null=True, blank=True)
    discarded_at = models.DateTimeField(null=True, blank=True)
    # Until when the worker storing it holds it (renewed while it works): a checkpoint still "storing" past
    # this was left by a worker that died, and the sweep asks for it again.
    store_lease_until = models.DateTimeField(null=True, blank=True)
    # runners.storage.chunks.Manifest.to_json(): the ordered chunks, the file's sha256 and size.
    manifest = models.JSONField(null=True, blank=True)
    # What it added to its tenant's stored bytes: while storing, its chunks no checkpoint of the tenant being
    # stored or durable held (its reservation); once durable, its chunks no durable checkpoint of the tenant
    # held at that moment (what the ledger charges it from then on, with its handovers).
    stored_bytes = models.PositiveBigIntegerField(default=0)

    class Meta:
        db_table = "runners_checkpoint"  # the table kept its name when the model moved here
        ordering = ["job_id", "step"]
        constraints = [models.UniqueConstraint(fields=["job", "step"], name="unique_checkpoint_step")]


class CheckpointHandover(models.Model):
    """Stored bytes a discarded checkpoint was charged for that a kept checkpoint still names: charged to the
    kept one from the discard (``handed_at``) until it is discarded in turn (runners.jobs.checkpoint_store)."""

    checkpoint = models.ForeignKey(Checkpoint, on_delete=models.CASCADE, related_name="handovers")
    bytes = models.PositiveBigIntegerField()
    handed_at = models.DateTimeField()


class JobMetric(models.Model):
    """One training step a job's rank 0 reported, recorded by the reconcile as it reads the job's progress.

    Kept in the database so the loss curve survives deleted pods and rotated logs; the pages
    and the API read it downsampled (runners.jobs.selectors.job_metric_series).
    """

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metrics")
    attempt = models.PositiveSmallIntegerField()
    step = models.PositiveIntegerField()
    loss = models.FloatField(null=True)
    samples_per_s = models.FloatField(null=True)
    at = models.CharField(max_length=40, blank=True)

    class Meta:
        db_table = "runners_jobmetric"  # the table kept its name when the model moved here
        ordering = ["job_id", "step", "attempt"]
        constraints = [models.UniqueConstraint(fields=["job", "step", "attempt"], name="unique_metric_step_attempt")]


class IdempotencyKey(models.Model):
    """A submit made with an Idempotency-Key header: the same key and body answer this job again for a day."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    key = models.CharField(max_length=255)
    request_hash = models.CharField(max_length=64)
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "runners_idempotencykey"  # the table kept its name when the model moved here
        constraints = [models.UniqueConstraint(fields=["user", "key"], name="unique_idempotency_key_per_user")]
        indexes = [models.Index(fields=["created_at"], name="idempotency_key_age")]


class JobEvent(models.Model):
    """One state change of a job, with its reason: the job page's event list."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(auto_now_add=True)
    from_state = models.CharField(max_length=20, blank=True)
    to_state = models.CharField(max_length=20)
    reason = models.CharField(max_length=1000, blank=True)

    class Meta:
        db_table = "runners_jobevent"  # the table kept its name when the model moved here
        ordering = ["job_id", "at", "id"]
