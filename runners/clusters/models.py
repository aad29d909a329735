"""The inventory: node pools, their nodes and GPUs, the partition profiles that cut them, and changes of profile."""

from django.conf import settings
from django.db import models

from quotas.models import PartitionKind


class NodePool(models.Model):
    """Nodes that share a GPU model and are partitioned alike."""

    name = models.CharField(max_length=63, unique=True)
    gpu_model = models.CharField(max_length=40, blank=True)
    partition_profile = models.ForeignKey(
        "clusters.PartitionProfile", null=True, blank=True, on_delete=models.SET_NULL, related_name="node_pools"
    )
    # Each node's cache of dataset shards and model weights (runners.storage.nodecache): where it lies on
    # the node and how many bytes it may hold; blank and 0 take the backend's defaults (NODE_CACHE_*).
    cache_path = models.CharField(max_length=255, blank=True)
    cache_bytes = models.PositiveBigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "runners_nodepool"  # the table kept its name when the model moved here
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
        db_table = "runners_node"  # the table kept its name when the model moved here
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
        db_table = "runners_gpu"  # the table kept its name when the model moved here
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
        db_table = "runners_partitionprofile"  # the table kept its name when the model moved here
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
        db_table = "runners_partitionchange"  # the table kept its name when the model moved here
        ordering = ["-created_at", "-id"]
        constraints = [
            # One change in flight per pool: two would fight over the same labels.
            models.UniqueConstraint(
                fields=["pool"],
                condition=~models.Q(state__in=["succeeded", "refused", "failed"]),
                name="one_partition_change_in_flight_per_pool",
            )
        ]
