from django.contrib import admin

from common.admin import ReadOnlyAdmin
from runners.inference.models import EndpointSample, InferenceEndpoint, Replica, ScaleEvent


@admin.register(InferenceEndpoint)
class InferenceEndpointAdmin(ReadOnlyAdmin):
    list_display = ["name", "tenant", "engine", "state", "desired_replicas", "min_replicas", "max_replicas",
                    "generation", "created_at"]
    list_filter = ["state", "tenant"]
    search_fields = ["name", "tenant__slug"]

    @admin.display(description="engine")
    def engine(self, endpoint: InferenceEndpoint) -> str:
        return endpoint.spec.get("engine") or "shipped"


@admin.register(Replica)
class ReplicaAdmin(ReadOnlyAdmin):
    list_display = ["endpoint", "slot", "generation", "job", "ready", "retiring", "address"]
    list_filter = ["ready", "retiring"]


@admin.register(ScaleEvent)
class ScaleEventAdmin(ReadOnlyAdmin):
    list_display = ["endpoint", "at", "from_replicas", "to_replicas", "reason"]


@admin.register(EndpointSample)
class EndpointSampleAdmin(ReadOnlyAdmin):
    list_display = ["endpoint", "at", "ready_replicas", "queue_depth", "requests_per_s", "p50_ms", "p99_ms",
                    "kv_cache_use"]
