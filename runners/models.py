"""Where work runs: environments, the inventory (node pools, nodes, GPUs) and how its GPUs are cut."""

from django.conf import settings
from django.db import models
from django.db.models import Q

from quotas.models import PartitionKind
from tenants.models import ENVIRONMENT_NAME_MAX, dns_label_validator


class NodePool(models.Model):
    """Nodes that share a GPU model and are partitioned alike."""

    name = models.CharField(max_length=63, unique=True)
    gpu_model = models.CharField(max_length=40, blank=True)
    partition_profile = models.ForeignKey(
        "runners.PartitionProfile", null=True, blank=True, on_delete=models.SET_NULL, related_name="node_pools"
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Node(models.Model):
    name = models.CharField(max_length=253, unique=True)
    pool = models.ForeignKey(NodePool, null=True, blank=True, on_delete=models.SET_NULL, related_name="nodes")
    cpu_milli = models.PositiveBigIntegerField()
    memory_mib = models.PositiveBigIntegerField()
    rack = models.CharField(max_length=63, blank=True)
    block = models.CharField(max_length=63, blank=True)
    nvlink_domain = models.CharField(max_length=253, blank=True)
    labels = models.JSONField(default=dict, blank=True)
    # Extended resources the node reports as allocatable (whole GPUs, MIG slices, shares; runners.nvidia.names).
    gpu_resources = models.JSONField(default=dict, blank=True)
    schedulable = models.BooleanField(default=True)
    source = models.CharField(max_length=20, help_text="The backend that reported this node.")
    seen_at = models.DateTimeField()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Gpu(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    model = models.CharField(max_length=40)
    memory_mib = models.PositiveIntegerField()
    uuid = models.CharField(max_length=100, blank=True)
    partition_kind = models.CharField(max_length=10, choices=PartitionKind.choices, default=PartitionKind.WHOLE)
    # [[profile, start], ...] as placed on this GPU when partition_kind is mig.
    mig_layout = models.JSONField(default=list, blank=True)
    timeslice_replicas = models.PositiveSmallIntegerField(default=1)

    class Meta:
        ordering = ["node__name", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="one_gpu_per_node_index")]

    def __str__(self) -> str:
        return f"{self.node.name}/gpu{self.index} ({self.model})"


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


class EnvironmentState(models.TextChoices):
    REQUESTED = "requested"
    PROVISIONING = "provisioning"
    READY = "ready"
    DELETING = "deleting"
    DELETED = "deleted"
    FAILED = "failed"


LIVE_STATES = [s for s in EnvironmentState.values if s != EnvironmentState.DELETED]


class Environment(models.Model):
    """A tenant's isolated slice of the cluster: a namespace (or workspace) with its quota."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="environments")
    name = models.CharField(max_length=ENVIRONMENT_NAME_MAX, validators=[dns_label_validator])
    namespace = models.CharField(max_length=63)
    backend = models.CharField(max_length=20)
    state = models.CharField(max_length=20, choices=EnvironmentState.choices, default=EnvironmentState.REQUESTED)
    status_message = models.CharField(max_length=500, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="environments_created"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    # Touched by every state change; the sweep uses it to find lost messages.
    state_changed_at = models.DateTimeField(auto_now_add=True)
    # How many times a worker started provisioning or teardown; redeliveries show here.
    task_runs = models.PositiveIntegerField(default=0)
    # Re-syncs (members or quota changed) coalesce: each change bumps sync_generation, at most
    # one sync message is pending (sync_pending), and the sync that holds the lease applies the
    # newest state until synced_generation catches up. See runners.environments.environments_resync.
    sync_generation = models.PositiveBigIntegerField(default=0)
    synced_generation = models.PositiveBigIntegerField(default=0)
    sync_pending = models.BooleanField(default=False)
    sync_requested_at = models.DateTimeField(null=True, blank=True)
    sync_lease_until = models.DateTimeField(null=True, blank=True)
    # When teardown was first asked for; a namespace Terminating much longer than
    # KUBERNETES_NAMESPACE_DELETE_TIMEOUT_S is reported on the environment as stuck.
    delete_requested_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["tenant__slug", "name"]
        constraints = [
            # Deleted environments keep their row for history; a live name is unique per tenant.
            models.UniqueConstraint(
                fields=["tenant", "name"], condition=~Q(state="deleted"), name="unique_live_environment_name"
            ),
            models.UniqueConstraint(
                fields=["namespace"], condition=~Q(state="deleted"), name="unique_live_environment_namespace"
            ),
        ]
        indexes = [models.Index(fields=["state", "state_changed_at"], name="environment_state_age")]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.name}"

    @property
    def is_transitional(self) -> bool:
        return self.state in (EnvironmentState.REQUESTED, EnvironmentState.PROVISIONING, EnvironmentState.DELETING)


# --- Jobs --------------------------------------------------------------------------


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

    State changes go through ``runners.jobs.transition`` only, which records each as a
    JobEvent with its reason.
    """

    class Kind(models.TextChoices):
        TRAINING = "training"

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="jobs")
    environment = models.ForeignKey(Environment, on_delete=models.PROTECT, related_name="jobs")
    name = models.CharField(max_length=63, validators=[dns_label_validator])
    kind = models.CharField(max_length=20, choices=Kind.choices, default=Kind.TRAINING)
    # The request as validated (the API's shape, tenant slug and environment id included).
    spec = models.JSONField()
    flavor = models.ForeignKey("quotas.ResourceFlavor", on_delete=models.PROTECT, related_name="jobs")
    replicas = models.PositiveSmallIntegerField()
    gpus_per_replica = models.PositiveSmallIntegerField()
    priority = models.PositiveSmallIntegerField(default=0)
    preemptible = models.BooleanField(default=True)
    state = models.CharField(max_length=20, choices=JobState.choices, default=JobState.QUEUED)
    reason = models.CharField(max_length=1000, blank=True)
    # Written by each scheduler cycle for queued jobs: 1 is next in line.
    queue_position = models.PositiveIntegerField(null=True, blank=True)
    # Failed attempts so far (preemptions and lost nodes do not count).
    failures = models.PositiveSmallIntegerField(default=0)
    # Set when the job is told to stop (preemption or cancel); after it, the backend kills.
    stop_deadline = models.DateTimeField(null=True, blank=True)
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

    class Meta:
        ordering = ["-submitted_at", "-id"]
        indexes = [
            models.Index(fields=["state", "priority"], name="job_state_priority"),
            models.Index(fields=["tenant", "state"], name="job_tenant_state"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.name}#{self.id}"

    @property
    def units(self) -> int:
        return self.replicas * self.gpus_per_replica


class JobAttempt(models.Model):
    """One launch of a job: where each replica was placed, and how it ended."""

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
    # relaunches an attempt whose lease is live; see runners.launch for the whole rule.
    launch_token = models.CharField(max_length=36, blank=True)
    launch_lease_until = models.DateTimeField(null=True, blank=True)
    # When its trainer finished its first step: max_runtime_s is counted from here.
    first_step_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job_id", "number"]
        constraints = [models.UniqueConstraint(fields=["job", "number"], name="unique_attempt_number")]

    def __str__(self) -> str:
        return f"{self.job_id}/{self.number}"


class Checkpoint(models.Model):
    """A checkpoint a job wrote: resuming starts from the newest."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="checkpoints")
    attempt = models.ForeignKey(JobAttempt, null=True, on_delete=models.SET_NULL, related_name="checkpoints")
    step = models.PositiveIntegerField()
    uri = models.CharField(max_length=1000)
    bytes = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField()

    class Meta:
        ordering = ["job_id", "step"]
        constraints = [models.UniqueConstraint(fields=["job", "step"], name="unique_checkpoint_step")]


class JobMetric(models.Model):
    """One training step a job's rank 0 reported, recorded by the reconcile as it reads the job's progress.

    Kept in the database so the loss curve survives deleted pods and rotated logs; the pages
    and the API read it downsampled (runners.selectors.job_metric_series).
    """

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metrics")
    attempt = models.PositiveSmallIntegerField()
    step = models.PositiveIntegerField()
    loss = models.FloatField(null=True)
    samples_per_s = models.FloatField(null=True)
    at = models.CharField(max_length=40, blank=True)

    class Meta:
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
        ordering = ["job_id", "at", "id"]


class SchedulerCycle(models.Model):
    """The one row the scheduler cycle updates first: its lock on databases without advisory locks, and its figures."""

    runs = models.PositiveBigIntegerField(default=0)
    last_started_at = models.DateTimeField(null=True, blank=True)
    last_duration_ms = models.FloatField(default=0)
    last_admitted = models.PositiveIntegerField(default=0)
    last_preempted = models.PositiveIntegerField(default=0)
    last_waiting = models.PositiveIntegerField(default=0)
    # The reconcile's one-pass-at-a-time lease on databases without advisory locks (PostgreSQL uses one).
    reconcile_lease_until = models.DateTimeField(null=True, blank=True)
