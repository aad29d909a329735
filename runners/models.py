"""Where work runs: the inventory of node pools, nodes and GPUs the backend discovered."""

from django.db import models


class PartitionKind(models.TextChoices):
    WHOLE = "whole"
    MIG = "mig"
    TIMESLICE = "timeslice"


class NodePool(models.Model):
    """Nodes that share a GPU model and are partitioned alike."""

    name = models.CharField(max_length=63, unique=True)
    gpu_model = models.CharField(max_length=40, blank=True)
    partition_profile = models.ForeignKey(
        "quotas.PartitionProfile", null=True, blank=True, on_delete=models.SET_NULL, related_name="node_pools"
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
