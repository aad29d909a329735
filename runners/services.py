"""Writes for the inventory and partition changes: the Django side of the backends."""

import logging
import time

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from quotas.models import PartitionChange, PartitionProfile
from runners.backends.base import NodeInfo, PartitionSpec, PermanentBackendError
from runners.backends.registry import get_backend
from runners.models import Gpu, Node, NodePool

logger = logging.getLogger(__name__)


@transaction.atomic
def inventory_sync(*, nodes: list[NodeInfo] | None = None) -> dict[str, int]:
    """Make Node, Gpu and NodePool rows match what the backend reports."""
    backend = get_backend()
    nodes = backend.discover_inventory() if nodes is None else nodes
    now = timezone.now()
    pools: dict[str, NodePool] = {}
    for info in nodes:
        if info.pool and info.pool not in pools:
            models = sorted({gpu.model for other in nodes if other.pool == info.pool for gpu in other.gpus})
            pool, _ = NodePool.objects.get_or_create(name=info.pool)
            gpu_model = models[0] if len(models) == 1 else ""
            if pool.gpu_model != gpu_model:
                pool.gpu_model = gpu_model
                pool.save(update_fields=["gpu_model", "updated_at"])
            pools[info.pool] = pool
    seen = []
    for info in nodes:
        node, _ = Node.objects.update_or_create(
            name=info.name,
            defaults={
                "pool": pools.get(info.pool),
                "cpu_milli": info.cpu_milli,
                "memory_mib": info.memory_mib,
                "rack": info.rack,
                "block": info.block,
                "nvlink_domain": info.nvlink_domain,
                "labels": info.labels,
                "gpu_resources": info.gpu_resources,
                "schedulable": info.schedulable,
                "source": backend.name,
                "seen_at": now,
            },
        )
        seen.append(node.id)
        indexes = []
        for gpu in info.gpus:
            indexes.append(gpu.index)
            Gpu.objects.update_or_create(
                node=node,
                index=gpu.index,
                defaults={
                    "model": gpu.model,
                    "memory_mib": gpu.memory_mib,
                    "uuid": gpu.uuid,
                    "partition_kind": gpu.partition_kind,
                    "mig_layout": [list(pair) for pair in gpu.mig_layout],
                    "timeslice_replicas": gpu.timeslice_replicas,
                },
            )
        Gpu.objects.filter(node=node).exclude(index__in=indexes).delete()
    removed, _ = Node.objects.exclude(id__in=seen).delete()
    return {"nodes": len(seen), "pools": len(pools), "removed": removed}


def partition_spec(profile: PartitionProfile) -> PartitionSpec:
    return PartitionSpec(
        name=profile.name,
        gpu_model=profile.gpu_model,
        kind=profile.kind,
        layout=tuple(profile.layout),
        replicas=profile.replicas,
    )


def pool_workloads(pool: NodePool) -> dict[str, list[str]]:
    """What runs on each node of the pool now, as the backend reports it."""
    backend = get_backend()
    return {name: backend.node_workloads(name) for name in pool.nodes.values_list("name", flat=True)}


def _record(change_id: int, *, state: str, message: str, node: str = "") -> None:
    """Append one step to the change's visible progress and move it to that state."""
    with transaction.atomic():
        change = PartitionChange.objects.select_for_update().get(id=change_id)
        change.state = state
        change.message = message[:1000]
        change.steps = [*change.steps, {"at": timezone.now().isoformat(), "node": node, "step": state, "message": message}]
        if state in PartitionChange.FINISHED:
            change.finished_at = timezone.now()
        change.save(update_fields=["state", "message", "steps", "finished_at"])


def partition_change_run(*, change_id: int) -> str:
    """Cordon, drain, relabel, wait and uncordon every node of the pool, recording each step.

    Each node is handed back (uncordoned) only once it reports the new
    resources, so nothing is scheduled onto a GPU that is being re-cut. A
    failure uncordons what this run cordoned, since the old partition is
    still in place until the relabel step.
    """
    claimed = PartitionChange.objects.filter(id=change_id, state=PartitionChange.State.PENDING).update(
        state=PartitionChange.State.CORDONING
    )
    change = PartitionChange.objects.select_related("pool", "profile").get(id=change_id)
    if not claimed:
        if change.state in PartitionChange.FINISHED:
            return change.state
        # A redelivery after a worker died mid-way: every step is idempotent, so start over.
        logger.warning("Partition change %s resumed from state %s", change_id, change.state)
    backend = get_backend()
    spec = partition_spec(change.profile)
    nodes = list(change.pool.nodes.order_by("name").values_list("name", flat=True))
    if not nodes:
        _record(change_id, state=PartitionChange.State.FAILED, message=f"Pool {change.pool.name} has no nodes.")
        return PartitionChange.State.FAILED
    relabeled = False
    try:
        for name in nodes:
            backend.cordon(name)
            Node.objects.filter(name=name).update(schedulable=False)
            _record(change_id, state=PartitionChange.State.CORDONING, node=name, message=f"Cordoned {name}.")
        busy = {name: backend.node_workloads(name) for name in nodes}
        busy = {name: names for name, names in busy.items() if names}
        if busy and change.drain == PartitionChange.Drain.WAIT:
            listed = "; ".join(f"{name}: {', '.join(names)}" for name, names in sorted(busy.items()))
            _uncordon_all(backend, nodes)
            _record(
                change_id,
                state=PartitionChange.State.REFUSED,
                message=f"Refused: work is running ({listed}). Apply with drain=preempt to checkpoint and preempt it.",
            )
            return PartitionChange.State.REFUSED
        for name, names in sorted(busy.items()):
            for workload in names:
                backend.evict(name, workload, grace_period_s=settings.PREEMPTION_GRACE_PERIOD_S)
            _record(
                change_id, state=PartitionChange.State.DRAINING, node=name,
                message=f"Asked {len(names)} workload(s) on {name} to checkpoint and stop.",
            )
        _wait(lambda: all(not backend.node_workloads(name) for name in nodes), what="workloads to stop")
        for name in nodes:
            backend.apply_partition(name, spec)
            relabeled = True
            _record(change_id, state=PartitionChange.State.RELABELING, node=name, message=f"Asked {name} for {spec.name}.")
        for name in nodes:
            _wait(lambda name=name: backend.partition_applied(name, spec), what=f"{name} to report {spec.name}")
            _record(change_id, state=PartitionChange.State.WAITING, node=name, message=f"{name} reports {spec.name}.")
        for name in nodes:
            backend.uncordon(name)
            Node.objects.filter(name=name).update(schedulable=True)
            _record(change_id, state=PartitionChange.State.UNCORDONING, node=name, message=f"Uncordoned {name}.")
    except (PermanentBackendError, TimeoutError) as exc:
        if not relabeled:
            _uncordon_all(backend, nodes)
        _record(change_id, state=PartitionChange.State.FAILED, message=f"Failed: {exc}")
        return PartitionChange.State.FAILED
    NodePool.objects.filter(id=change.pool_id).update(partition_profile=change.profile, updated_at=timezone.now())
    inventory_sync()
    _record(change_id, state=PartitionChange.State.SUCCEEDED, message=f"Pool {change.pool.name} now runs {spec.name}.")
    return PartitionChange.State.SUCCEEDED


def _uncordon_all(backend, nodes: list[str]) -> None:
    for name in nodes:
        backend.uncordon(name)
    Node.objects.filter(name__in=nodes).update(schedulable=True)


def _wait(predicate, *, what: str) -> None:
    deadline = time.monotonic() + settings.PARTITION_APPLY_TIMEOUT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"Timed out after {settings.PARTITION_APPLY_TIMEOUT_S}s waiting for {what}.")
        time.sleep(settings.PARTITION_POLL_INTERVAL_S)
