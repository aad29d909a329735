"""The inventory and partitions in the Django admin, read-only: the inventory sync and the partition
pages (and their services) are what change them."""

from django.contrib import admin

from common.admin import ReadOnlyAdmin
from runners.clusters.models import Gpu, Node, NodePool, PartitionChange, PartitionProfile


@admin.register(NodePool)
class NodePoolAdmin(ReadOnlyAdmin):
    list_display = ["name", "gpu_model", "partition_profile", "updated_at"]
    search_fields = ["name"]


@admin.register(Node)
class NodeAdmin(ReadOnlyAdmin):
    list_display = ["name", "pool", "rack", "nvlink_domain", "schedulable", "source", "seen_at"]
    list_filter = ["schedulable", "pool", "source"]
    search_fields = ["name"]


@admin.register(Gpu)
class GpuAdmin(ReadOnlyAdmin):
    list_display = ["node", "index", "model", "memory_mib", "partition_kind", "timeslice_replicas"]
    list_filter = ["model", "partition_kind"]
    search_fields = ["node__name", "uuid"]


@admin.register(PartitionProfile)
class PartitionProfileAdmin(ReadOnlyAdmin):
    list_display = ["name", "gpu_model", "kind", "layout", "replicas", "created_at"]
    list_filter = ["kind", "gpu_model"]


@admin.register(PartitionChange)
class PartitionChangeAdmin(ReadOnlyAdmin):
    list_display = ["id", "pool", "profile", "drain", "state", "created_by", "created_at", "finished_at"]
    list_filter = ["state", "drain"]
