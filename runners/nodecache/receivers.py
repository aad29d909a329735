"""The node caches' answers: an attempt's end (its pins released, what its fills added to be seen) and the
caches' figures on ``/metrics``."""

import time

from django.db import transaction
from django.dispatch import receiver
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.dispatch import send_task_at_most_every
from common.metrics import metrics_collect
from runners.jobs.signals import attempts_ended
from runners.nodecache.models import NodeCacheState

SYNC_TASK = "runners.nodecache.tasks.caches_sync"
# Many attempts ending together ask for one sync, not one each.
SYNC_WINDOW_S = 1.0


@receiver(attempts_ended, dispatch_uid="nodecache-syncs-after-attempts-end")
def _attempts_ended(sender, **kwargs) -> None:
    asked_at = time.time()
    transaction.on_commit(lambda: send_task_at_most_every(SYNC_WINDOW_S, SYNC_TASK, asked_at))


@receiver(metrics_collect, dispatch_uid="nodecache-figures")
def _cache_figures(sender, **kwargs) -> list:
    """Each node's cache: bytes held and capacity, hits, misses and bytes pulled from the store (as last synced)."""
    held = GaugeMetricFamily("portal_node_cache_bytes", "Bytes each node's cache holds.", labels=["node"])
    capacity = GaugeMetricFamily("portal_node_cache_capacity_bytes", "The most each node's cache may hold.",
                                 labels=["node"])
    hits = CounterMetricFamily("portal_node_cache_hits", "Blobs an attempt found in its node's cache.",
                               labels=["node"])
    misses = CounterMetricFamily("portal_node_cache_misses", "Blobs pulled from the store into a node's cache.",
                                 labels=["node"])
    pulled = CounterMetricFamily("portal_node_cache_pulled_bytes", "Bytes pulled from the store into each node's cache.",
                                 labels=["node"])
    for state in NodeCacheState.objects.select_related("node").order_by("node__name"):
        name = [state.node.name]
        held.add_metric(name, state.bytes_held)
        capacity.add_metric(name, state.capacity_bytes)
        hits.add_metric(name, state.hits)
        misses.add_metric(name, state.misses)
        pulled.add_metric(name, state.bytes_pulled)
    return [held, capacity, hits, misses, pulled]
