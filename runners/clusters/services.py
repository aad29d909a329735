"""Writes for the inventory, flavor capacity, partition profiles and partition changes.

The Django side of the backends. Runners owns the inventory, so it writes down
what quotas needs from it: after every change of the schedulable inventory
(sync, cordon, uncordon) each flavor's ``capacity`` is recomputed here
(``flavor_capacity_refresh``), with the one rule for how many units a GPU offers.

A node's row is the seam between a cordon and the scheduler cycle. The cycle, before it commits,
locks the rows of the nodes it placed on and re-reads them (``nodes_locked_unschedulable``); a
cordon writes those rows before it asks what is placed there. So either the cordon waits for the
cycle's commit and then sees its attempts, or the cycle sees the node cordoned and places nothing
there. Whoever locks several nodes locks them in id order, so the two never deadlock.
"""

import logging
from collections import Counter
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from audit.services import SYSTEM, record, snapshot
from common.dispatch import enqueue_on_commit, send_task
from common.errors import Invalid
from quotas.models import PartitionKind, Quota, ResourceFlavor
from quotas.services import gpu_model_check, guarantees_shrink, require_staff
from runners.backends.base import BackendError, NodeInfo, PartitionSpec, PermanentBackendError
from runners.clusters import signals
from runners.clusters.models import Gpu, Node, NodePool, PartitionChange, PartitionProfile
from runners.clusters.registry import get_backend
from runners.nvidia import catalog, mig

MAX_TIMESLICE_REPLICAS = 64

logger = logging.getLogger(__name__)


# What a sync writes over on a node or GPU row it finds already there (the rest is the portal's own).
_NODE_SYNCED_FIELDS = ["pool", "cpu_milli", "memory_mib", "rack", "block", "nvlink_domain", "labels",
                       "gpu_resources", "schedulable", "source", "seen_at"]
_GPU_SYNCED_FIELDS = ["model", "memory_mib", "uuid", "partition_kind", "mig_layout", "timeslice_replicas"]


def inventory_sync(*, nodes: list[NodeInfo] | None = None) -> dict[str, int]:
    """Make Node, Gpu and NodePool rows match what the backend reports.

    The cluster is asked first, outside any transaction (a node list can take seconds); what it
    said is then written in one short transaction.
    """
    backend = get_backend()
    nodes = backend.discover_inventory() if nodes is None else nodes
    with transaction.atomic():
        return _inventory_write(nodes, source=backend.name)


def _inventory_write(nodes: list[NodeInfo], *, source: str) -> dict[str, int]:
    now = timezone.now()
    # Every node row this writes, locked first in id order (a cycle in flight holds some: see the module's note).
    list(Node.objects.select_for_update().order_by("id").values_list("id", flat=True))
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
    # Two statements for the whole cluster, however large (INSERT ... ON CONFLICT DO UPDATE, ids returned):
    # one for the nodes by name, one for their GPUs by (node, index). A node named twice in the list is
    # written as its last entry says, as one upsert a node would have been.
    by_name = {info.name: info for info in nodes}
    node_rows = Node.objects.bulk_create(
        [
            Node(name=info.name, pool=pools.get(info.pool), cpu_milli=info.cpu_milli, memory_mib=info.memory_mib,
                 rack=info.rack, block=info.block, nvlink_domain=info.nvlink_domain, labels=info.labels,
                 gpu_resources=info.gpu_resources, schedulable=info.schedulable, source=source, seen_at=now)
            for info in by_name.values()
        ],
        update_conflicts=True, unique_fields=["name"], update_fields=_NODE_SYNCED_FIELDS,
    )
    seen = [node.id for node in node_rows]
    gpu_rows = [
        Gpu(node_id=node.id, index=gpu.index, model=gpu.model, memory_mib=gpu.memory_mib, uuid=gpu.uuid,
            partition_kind=gpu.partition_kind, mig_layout=[list(pair) for pair in gpu.mig_layout],
            timeslice_replicas=gpu.timeslice_replicas)
        for node in node_rows
        for gpu in {gpu.index: gpu for gpu in by_name[node.name].gpus}.values()
    ]
    kept = Gpu.objects.bulk_create(
        gpu_rows, update_conflicts=True, unique_fields=["node", "index"], update_fields=_GPU_SYNCED_FIELDS,
    ) if gpu_rows else []
    Gpu.objects.filter(node_id__in=seen).exclude(id__in=[gpu.id for gpu in kept]).delete()
    _, deleted = Node.objects.exclude(id__in=seen).delete()
    removed = deleted.get(Node._meta.label, 0)  # nodes, not their GPUs too
    flavor_capacity_refresh()
    return {"nodes": len(seen), "pools": len(pools), "removed": removed}


def partition_spec(profile: PartitionProfile) -> PartitionSpec:
    return PartitionSpec(
        name=profile.name,
        gpu_model=profile.gpu_model,
        kind=profile.kind,
        layout=tuple(profile.layout),
        replicas=profile.replicas,
    )


def partition_profile_check(*, gpu_model: str, kind: str, layout: list[str], replicas: int | None) -> int:
    """Validate a profile's shape against NVIDIA's geometry; returns the replicas to store.

    Raises Invalid naming the field. The partition page's preview calls
    this too, so it never promises what saving would refuse.
    """
    model = gpu_model_check("gpu_model", gpu_model)
    if kind == PartitionKind.MIG:
        if not model.mig_capable:
            raise Invalid("gpu_model", f"{gpu_model} does not support MIG; use kind whole or timeslice.")
        if not layout:
            raise Invalid("layout", "A mig profile needs a layout: the MIG profiles of one GPU.")
        try:
            mig.fit_layout(gpu_model, layout)
        except mig.MigError as exc:
            raise Invalid("layout", str(exc)) from None
    elif layout:
        raise Invalid("layout", "Only mig profiles take a layout.")
    if kind == PartitionKind.TIMESLICE:
        if replicas is None or not 2 <= replicas <= MAX_TIMESLICE_REPLICAS:
            raise Invalid("replicas", f"Time-slicing needs between 2 and {MAX_TIMESLICE_REPLICAS} replicas per GPU.")
        return replicas
    if replicas not in (None, 1):
        raise Invalid("replicas", "Only timeslice profiles take replicas.")
    return 1


def partition_profile_create(
    *, actor: AbstractBaseUser, name: str, gpu_model: str, kind: str, layout: list[str], replicas: int | None
) -> PartitionProfile:
    """Validate a layout against NVIDIA's geometry and store it as a named profile."""
    require_staff(actor)
    replicas = partition_profile_check(gpu_model=gpu_model, kind=kind, layout=layout, replicas=replicas)
    if PartitionProfile.objects.filter(name=name).exists():
        raise Invalid("name", f"A partition profile named {name!r} already exists.")
    try:
        with transaction.atomic():
            profile = PartitionProfile.objects.create(name=name, gpu_model=gpu_model, kind=kind, layout=layout, replicas=replicas)
            record("partition_profile.created", actor=actor, obj=profile,
                   after=snapshot(profile, ["name", "gpu_model", "kind", "layout", "replicas"]))
            return profile
    except IntegrityError:
        raise Invalid("name", f"A partition profile named {name!r} already exists.") from None


# The most a node pool's cache may be set to hold: a petabyte is past any node's local NVMe.
NODE_CACHE_MAX_BYTES = 10**15


def node_pool_cache_set(*, actor: AbstractBaseUser, pool: NodePool, cache_path: str, cache_bytes: int) -> NodePool:
    """Where each node of the pool keeps its cache of shards and weights, and how many bytes it may hold (staff).

    A blank path and 0 bytes take the backend's defaults (NODE_CACHE_DIR and NODE_CACHE_BYTES on the local
    backend). The path is an absolute folder on the nodes; a node's cache agent (or, on the local backend, the
    next attempt's supervisor) keeps its cache there, within the size, from the next fill on."""
    require_staff(actor)
    if not isinstance(cache_path, str) or len(cache_path) > 255:
        raise Invalid("cache_path", "A folder's absolute path, at most 255 characters, or blank for the default.")
    cache_path = cache_path.strip()
    if cache_path and (not cache_path.startswith("/") or "\0" in cache_path
                       or any(part in (".", "..") for part in cache_path.split("/"))):
        raise Invalid("cache_path", "An absolute path on the nodes (starting with /, no . or .. parts), or blank.")
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or not 0 <= cache_bytes <= NODE_CACHE_MAX_BYTES:
        raise Invalid("cache_bytes", f"Whole bytes from 0 (the default size) to {NODE_CACHE_MAX_BYTES}.")
    with transaction.atomic():
        locked = NodePool.objects.select_for_update().get(id=pool.id)
        before = snapshot(locked, ["cache_path", "cache_bytes"])
        locked.cache_path, locked.cache_bytes = cache_path, cache_bytes
        locked.save(update_fields=["cache_path", "cache_bytes", "updated_at"])
        record("node_pool.cache_changed", actor=actor, obj=locked, object_repr=locked.name, before=before,
               after=snapshot(locked, ["cache_path", "cache_bytes"]))
    return locked


def pool_workloads(pool: NodePool) -> dict[str, list[str]]:
    """What runs on each node of the pool now: what the backend reports, and the portal's jobs placed there.

    A job admitted but not launched yet runs nothing the backend could report, but it is about
    to: it counts as work on its nodes so that no re-partitioning pulls them from under it.
    """
    backend = get_backend()
    names = list(pool.nodes.values_list("name", flat=True))
    placed = signals.placed(names)
    return {name: sorted(set(backend.node_workloads(name)) | set(placed.get(name, []))) for name in names}


def flavor_units_per_node(flavor: ResourceFlavor) -> dict[str, int]:
    """Units of the flavor each schedulable node offers (the same rule as flavor_capacity_refresh)."""
    per_node: dict[str, int] = {}
    shape = (flavor.kind, flavor.gpu_model, flavor.mig_profile)
    by_node: dict[str, list] = {}
    for gpu in Gpu.objects.filter(node__schedulable=True, model=flavor.gpu_model).select_related("node"):
        by_node.setdefault(gpu.node.name, []).append(gpu)
    for name, gpus in by_node.items():
        units = _units_of(gpus).get(shape, 0)
        if units:
            per_node[name] = units
    return per_node


def _record(change_id: int, *, state: str, message: str, node: str = "") -> None:
    """Append one step to the change's visible progress and move it to that state."""
    with transaction.atomic():
        change = PartitionChange.objects.select_for_update().get(id=change_id)
        change.state = state
        change.message = message[:1000]
        change.steps = [*change.steps, {"at": timezone.now().isoformat(), "node": node, "step": state, "message": message}]
        if state in PartitionChange.FINISHED:
            change.finished_at = timezone.now()
            change.lease_expires_at = None
        else:
            change.lease_expires_at = timezone.now() + timedelta(seconds=settings.PARTITION_LEASE_S)
        change.save(update_fields=["state", "message", "steps", "finished_at", "lease_expires_at"])
        if state in PartitionChange.FINISHED:
            record(f"partition_change.{state}", actor=SYSTEM, obj=change, object_repr=_change_repr(change),
                   after={"state": state, "message": change.message})


def _change_repr(change: PartitionChange) -> str:
    return f"{change.profile.name} on pool {change.pool.name}"


def partition_change_step(*, change_id: int, lease: str | None = None) -> tuple[str, float | None, str | None]:
    """Advance a partition change by one step; never waits for the cluster.

    Steps, one per call: cordon every node and look for work (refuse, or evict
    it when ``drain`` is preempt); wait for evicted work to stop; relabel every
    node; wait until every node reports the new resources; uncordon and finish.
    A node is handed back only once it reports the new resources, so nothing is
    scheduled onto a GPU being re-cut; a failure before the relabel uncordons
    what the change cordoned, since the old partition is still in place.

    Returns ``(state, delay_s, lease)``: run again after ``delay_s`` passing
    ``lease`` (None when the change finished, or when this call could not claim
    it: another run holds a live lease). Between steps the change stays leased
    to that follow-up, so the sweep only resends it when the follow-up is lost;
    no lock is held across a backend call.
    """
    now = timezone.now()
    free = Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now)
    if lease:
        free |= Q(lease_expires_at=datetime.fromisoformat(lease))
    claimed = (
        PartitionChange.objects.filter(id=change_id)
        .exclude(state__in=PartitionChange.FINISHED)
        .filter(free)
        .update(lease_expires_at=now + timedelta(seconds=settings.PARTITION_LEASE_S))
    )
    change = PartitionChange.objects.select_related("pool", "profile").get(id=change_id)
    if not claimed:
        return change.state, None, None
    backend = get_backend()
    nodes = list(change.pool.nodes.order_by("name").values_list("name", flat=True))
    if not nodes:
        _record(change_id, state=PartitionChange.State.FAILED, message=f"Pool {change.pool.name} has no nodes.")
        return PartitionChange.State.FAILED, None, None
    relabeled = change.state in (
        PartitionChange.State.RELABELING, PartitionChange.State.WAITING, PartitionChange.State.UNCORDONING
    )
    try:
        delay = _partition_step(change, backend, nodes)
    except (PermanentBackendError, TimeoutError) as exc:
        if not relabeled:
            _uncordon_all(backend, _handed_back(change, nodes))
        _record(change_id, state=PartitionChange.State.FAILED, message=f"Failed: {exc}")
        return PartitionChange.State.FAILED, None, None
    state = PartitionChange.objects.values_list("state", flat=True).get(id=change_id)
    if delay is None:
        return state, None, None
    until = timezone.now() + timedelta(seconds=delay + settings.PARTITION_LEASE_S)
    PartitionChange.objects.filter(id=change_id).update(lease_expires_at=until)
    return state, delay, until.isoformat()


def _handed_back(change: PartitionChange, nodes: list[str]) -> list[str]:
    """The nodes the change uncordons at the end: all but those an operator had cordoned before."""
    return [name for name in nodes if name not in change.kept_cordoned]


def _phase_started(change: PartitionChange, state: str, *, latest: bool = False) -> datetime:
    """When the change recorded its first (or latest) step of a state."""
    times = [datetime.fromisoformat(step["at"]) for step in change.steps if step["step"] == state]
    if not times:
        return timezone.now()
    return max(times) if latest else min(times)


def _move(change_id: int, state: str) -> None:
    """Go on to the next state without a visible step (the per-node steps tell the story)."""
    PartitionChange.objects.filter(id=change_id).update(state=state)


def _check_timeout(change: PartitionChange, state: str, what: str, *, latest: bool = False) -> None:
    """Fail once `what` has been awaited longer than PARTITION_APPLY_TIMEOUT_S since the step of `state`."""
    waited = (timezone.now() - _phase_started(change, state, latest=latest)).total_seconds()
    if waited > settings.PARTITION_APPLY_TIMEOUT_S:
        raise TimeoutError(f"Timed out after {settings.PARTITION_APPLY_TIMEOUT_S}s waiting for {what}.")


def _partition_step(change: PartitionChange, backend, nodes: list[str]) -> float | None:
    """Do the one step the change's state calls for; the delay before the next one, or None when finished."""
    State = PartitionChange.State
    poll = settings.PARTITION_POLL_INTERVAL_S
    spec = partition_spec(change.profile)
    if change.state in (State.PENDING, State.CORDONING):
        if change.state == State.PENDING:
            kept = list(change.pool.nodes.filter(schedulable=False).order_by("name").values_list("name", flat=True))
            PartitionChange.objects.filter(id=change.id).update(state=State.CORDONING, kept_cordoned=kept)
            change.kept_cordoned = kept
        for name in nodes:
            backend.cordon(name)
            _record(change.id, state=State.CORDONING, node=name, message=f"Cordoned {name}.")
        _set_schedulable(nodes, False)  # once for the pool: one capacity refresh, not one per node
        placed = signals.placed(nodes)
        busy = {name: sorted(set(backend.node_workloads(name)) | set(placed.get(name, []))) for name in nodes}
        busy = {name: names for name, names in busy.items() if names}
        if busy and change.drain == PartitionChange.Drain.WAIT:
            listed = "; ".join(f"{name}: {', '.join(names)}" for name, names in sorted(busy.items()))
            _uncordon_all(backend, _handed_back(change, nodes))
            _record(
                change.id, state=State.REFUSED,
                message=f"Refused: work is running ({listed}). Apply with drain=preempt to checkpoint and preempt it.",
            )
            return None
        # The portal's own jobs stop through the portal (checkpoint, requeue elsewhere), including
        # those admitted but not launched yet; anything else on the nodes is evicted by the backend.
        ours = signals.drain(nodes, reason=f"Preempted: node pool {change.pool.name} is being re-partitioned.")
        for name, names in sorted(busy.items()):
            for workload in names:
                # Whose a pod is comes from its labels (a Job's pod is job-<id>-<attempt>-<index>-<suffix>).
                if backend.workload_job(workload) not in ours:
                    backend.evict(name, workload, grace_period_s=settings.PREEMPTION_GRACE_PERIOD_S)
            _record(
                change.id, state=State.DRAINING, node=name,
                message=f"Asked {len(names)} workload(s) on {name} to checkpoint and stop.",
            )
        if busy:
            return poll
        _move(change.id, State.RELABELING)
        return 0
    if change.state == State.DRAINING:
        placed = signals.placed(nodes)
        busy = False
        for name in nodes:
            held = {workload.rsplit("/", 1)[-1] for workload in placed.get(name, [])}
            running = backend.node_workloads(name)
            for workload in running:
                if backend.workload_job(workload) not in held:
                    # Not a job the portal is stopping: evicted again (a PodDisruptionBudget may have said not yet).
                    backend.evict(name, workload, grace_period_s=settings.PREEMPTION_GRACE_PERIOD_S)
            busy = busy or bool(running or placed.get(name))
        if busy:
            _check_timeout(change, State.DRAINING, "workloads to stop")
            return poll
        _move(change.id, State.RELABELING)
        return 0
    if change.state == State.RELABELING:
        for name in nodes:
            backend.apply_partition(name, spec)
            _record(change.id, state=State.RELABELING, node=name, message=f"Asked {name} for {spec.name}.")
        _move(change.id, State.WAITING)
        return poll
    if change.state == State.WAITING:
        reported = {step["node"] for step in change.steps if step["step"] == State.WAITING and step["node"]}
        for name in nodes:
            if name not in reported and backend.partition_applied(name, spec):
                _record(change.id, state=State.WAITING, node=name, message=f"{name} reports {spec.name}.")
                reported.add(name)
        if not set(nodes) <= reported:
            missing = ", ".join(name for name in nodes if name not in reported)
            _check_timeout(change, State.RELABELING, f"{missing} to report {spec.name}", latest=True)
            return poll
        _move(change.id, State.UNCORDONING)
        return 0
    # UNCORDONING: hand the nodes back, then take in what the cluster now reports.
    handed_back = _handed_back(change, nodes)
    for name in handed_back:
        backend.uncordon(name)
        _record(change.id, state=State.UNCORDONING, node=name, message=f"Uncordoned {name}.")
    _set_schedulable(handed_back, True)
    NodePool.objects.filter(id=change.pool_id).update(partition_profile=change.profile, updated_at=timezone.now())
    inventory_sync()
    flavors_discover()
    _record(change.id, state=State.SUCCEEDED, message=f"Pool {change.pool.name} now runs {spec.name}.")
    return None


def _uncordon_all(backend, nodes: list[str]) -> None:
    for name in nodes:
        backend.uncordon(name)
    _set_schedulable(nodes, True)


def _set_schedulable(nodes: list[str], schedulable: bool) -> None:
    """Record a cordon or uncordon the backend just did, and the capacity it leaves.

    The rows are locked first, in id order: a cycle that placed on one of them commits first, so
    what it placed there is seen by whoever asks after this (see the module's note).
    """
    with transaction.atomic():
        ids = list(Node.objects.select_for_update().filter(name__in=nodes).order_by("id").values_list("id", flat=True))
        Node.objects.filter(id__in=ids).update(schedulable=schedulable)
    flavor_capacity_refresh()


def nodes_locked_unschedulable(names) -> set[str]:
    """Of these nodes, those cordoned or gone, read under their rows' locks (held until the caller's
    transaction ends); the scheduler cycle asks this of the nodes it placed on, just before it commits."""
    names = set(names)
    if not names:
        return set()
    rows = (Node.objects.select_for_update(no_key=True).filter(name__in=names).order_by("id")
            .values_list("name", "schedulable"))
    return names - {name for name, schedulable in rows if schedulable}


def partition_change_release(*, change_id: int) -> None:
    """Let the next retry claim the change at once (after a transient error)."""
    PartitionChange.objects.filter(id=change_id).update(lease_expires_at=None)


def partition_change_give_up(*, change_id: int, reason: str) -> None:
    """Mark a change failed after its retries ran out, handing back nodes not yet re-cut."""
    change = PartitionChange.objects.select_related("pool").get(id=change_id)
    if change.state in PartitionChange.FINISHED:
        return
    if change.state in (PartitionChange.State.PENDING, PartitionChange.State.CORDONING, PartitionChange.State.DRAINING):
        # The old partition is still in place: the nodes can take work again.
        nodes = [n for n in change.pool.nodes.values_list("name", flat=True) if n not in change.kept_cordoned]
        try:
            _uncordon_all(get_backend(), nodes)
        except BackendError as exc:
            reason = f"{reason}; could not uncordon either ({exc})"
    _record(change_id, state=PartitionChange.State.FAILED, message=f"Gave up after repeated errors: {reason}")


def partition_change_sweep(*, stuck_after_s: int) -> list[int]:
    """Re-enqueue unfinished changes nobody holds: a lost message or a dead worker."""
    now = timezone.now()
    stale = (
        PartitionChange.objects.exclude(state__in=PartitionChange.FINISHED)
        .filter(Q(lease_expires_at__lt=now) | Q(lease_expires_at__isnull=True, created_at__lt=now - timedelta(seconds=stuck_after_s)))
        .values_list("id", flat=True)
    )
    found = list(stale)
    for change_id in found:
        send_task("runners.tasks.partition_apply", change_id)
    if found:
        logger.warning("Sweep re-enqueued partition changes: %s", found)
    return found


# --- Capacity per flavor, and what a partition change does to it ---------------------

Shape = tuple[str, str, str]  # (partition kind, GPU model, MIG profile or "")


def _gpu_units(kind: str, model: str, mig_profiles: list[str], replicas: int) -> Counter[Shape]:
    """The flavor units one GPU offers when cut this way."""
    if kind == PartitionKind.MIG:
        return Counter((PartitionKind.MIG, model, profile) for profile in mig_profiles)
    if kind == PartitionKind.TIMESLICE:
        return Counter({(PartitionKind.TIMESLICE, model, ""): replicas})
    return Counter({(PartitionKind.WHOLE, model, ""): 1})


def gpu_units(gpu: Gpu) -> Counter[Shape]:
    """The flavor units (by shape) this GPU offers as it is cut now."""
    return _gpu_units(gpu.partition_kind, gpu.model, [p for p, _start in gpu.mig_layout], gpu.timeslice_replicas)


def _units_of(gpus) -> Counter[Shape]:
    units: Counter[Shape] = Counter()
    for gpu in gpus:
        units += gpu_units(gpu)
    return units


def flavor_capacity_refresh() -> int:
    """Write every flavor's capacity (units the schedulable inventory holds now); returns how many changed."""
    units = _units_of(Gpu.objects.filter(node__schedulable=True))
    now = timezone.now()
    changed: dict[int, int] = {}
    for flavor in ResourceFlavor.objects.only("id", "kind", "gpu_model", "mig_profile", "capacity"):
        capacity = units.get((flavor.kind, flavor.gpu_model, flavor.mig_profile), 0)
        if capacity != flavor.capacity and ResourceFlavor.objects.filter(id=flavor.id).update(
            capacity=capacity, capacity_updated_at=now
        ):
            changed[flavor.id] = capacity
    if changed:
        signals.capacity_changed.send(sender=None, capacities=changed, at=now)
    return len(changed)


def _discovered_flavor_name(shape: Shape) -> str:
    kind, model, profile = shape
    if kind == PartitionKind.MIG:
        return catalog.mig_flavor(model, profile).name
    if kind == PartitionKind.TIMESLICE:
        return f"{catalog.whole_gpu_flavor(model).name}-shared"
    return catalog.whole_gpu_flavor(model).name


def flavors_discover(*, actor=None) -> list[ResourceFlavor]:
    """Give every kind of capacity the inventory reports a flavor; returns the ones created.

    A new flavor has no price card: staff see it marked "no price yet" until they set one.
    `actor`: the staff member who asked, for the audit log (None: the inventory sync did).
    """
    created = []
    for shape in sorted(_units_of(Gpu.objects.all())):
        kind, model, profile = shape
        if ResourceFlavor.objects.filter(kind=kind, gpu_model=model, mig_profile=profile).exists():
            continue
        try:
            name = _discovered_flavor_name(shape)
        except mig.UnknownGpuModelError:
            # A model the catalog does not know (yet) cannot be named or checked; staff may still
            # make a flavor for it by hand. One unknown model must not stop discovery of the rest.
            logger.warning("No flavor discovered for %s GPUs: the GPU catalog does not know the model.", model)
            continue
        if ResourceFlavor.objects.filter(name=name).exists():
            name = f"{name}-{kind}"[:63]
        try:
            with transaction.atomic():
                flavor = ResourceFlavor.objects.create(
                    name=name, kind=kind, gpu_model=model, mig_profile=profile,
                    description="Found in the inventory; no price yet.",
                )
                record("flavor.created", actor=actor, obj=flavor,
                       after=snapshot(flavor, ["name", "kind", "gpu_model", "mig_profile", "description"]))
                created.append(flavor)
        except IntegrityError:
            continue  # another sync made it at the same moment
    if created:
        flavor_capacity_refresh()
    return created


def pool_capacity_change(*, pool: NodePool, profile: PartitionProfile) -> list[dict]:
    """Per flavor: schedulable capacity now and once the profile is applied to the pool.

    Each row also lists the tenants whose guarantees would then no longer fit
    (the flavor's guarantees add up to more than the new capacity).
    """
    schedulable = Gpu.objects.filter(node__schedulable=True)
    now = _units_of(schedulable)
    pool_gpus = list(schedulable.filter(node__pool=pool))
    after = now - _units_of(pool_gpus)
    for _gpu in pool_gpus:
        after += _gpu_units(profile.kind, profile.gpu_model, list(profile.layout), profile.replicas)
    flavors = {(f.kind, f.gpu_model, f.mig_profile): f for f in ResourceFlavor.objects.all()}
    rows = []
    for shape in sorted(set(now) | set(after)):
        before_units, after_units = now.get(shape, 0), after.get(shape, 0)
        if before_units == after_units:
            continue
        flavor = flavors.get(shape)
        quotas = list(Quota.objects.filter(flavor=flavor, guaranteed__gt=0).select_related("tenant")) if flavor else []
        guaranteed = sum(quota.guaranteed for quota in quotas)
        rows.append(
            {
                "flavor": flavor.name if flavor else _discovered_flavor_name(shape),
                "new_flavor": flavor is None,
                "kind": shape[0],
                "gpu_model": shape[1],
                "mig_profile": shape[2],
                "capacity_before": before_units,
                "capacity_after": after_units,
                "guaranteed": guaranteed,
                "unbacked": [
                    {"tenant": quota.tenant.slug, "guaranteed": quota.guaranteed}
                    for quota in quotas
                ] if guaranteed > after_units else [],
            }
        )
    return rows


def node_pool_apply(
    *, actor, pool: NodePool, profile: PartitionProfile, drain: str, shrink_guarantees: bool = False,
    dry_run: bool = False,
) -> dict:
    """Preview or start a partition change, refusing one that would strand guarantees.

    Returns {"capacity": rows, "change": PartitionChange or None}. When guarantees
    would exceed the new capacity the apply is refused (400 naming `profile`)
    unless `shrink_guarantees`, which lowers them in proportion, recorded, in the
    same transaction that starts the change.
    """
    capacity = pool_capacity_change(pool=pool, profile=profile)
    if dry_run:
        require_staff(actor)
        return {"capacity": capacity, "change": None}
    stranded = [row for row in capacity if row["unbacked"]]
    if stranded and not shrink_guarantees:
        listed = "; ".join(
            f"{row['flavor']}: {row['guaranteed']} guaranteed, {row['capacity_after']} left "
            f"({', '.join(item['tenant'] for item in row['unbacked'])})"
            for row in stranded
        )
        raise Invalid("profile", f"Applying {profile.name} to {pool.name} leaves guarantees without capacity ({listed}). "
                        "Lower them first, or apply with shrink_guarantees=true to lower them in proportion.")
    workloads = pool_workloads(pool)
    with transaction.atomic():
        for row in stranded:
            guarantees_shrink(
                actor=actor, flavor=ResourceFlavor.objects.get(name=row["flavor"]), capacity=row["capacity_after"],
                reason=f"Pool {pool.name} re-partitioned to {profile.name}: capacity {row['capacity_before']} -> "
                       f"{row['capacity_after']}.",
            )
        change = partition_change_start(actor=actor, pool=pool, profile=profile, drain=drain, workloads=workloads)
    return {"capacity": capacity, "change": change}


def partition_change_start(
    *, actor: AbstractBaseUser, pool: NodePool, profile: PartitionProfile, drain: str, workloads: dict[str, list[str]]
) -> PartitionChange:
    """Start applying a profile to a pool; refuse while work runs unless asked to preempt it.

    ``workloads`` is what runs on each of the pool's nodes now (the caller asks
    the backend); the task checks again after cordoning, since work may have
    started in between.
    """
    require_staff(actor)
    if drain not in PartitionChange.Drain.values:
        raise Invalid("drain", f"{drain!r} is not one of: wait, preempt.")
    if pool.gpu_model and profile.gpu_model != pool.gpu_model:
        raise Invalid("profile", f"Profile {profile.name} is for {profile.gpu_model}; pool {pool.name} has {pool.gpu_model} GPUs.")
    busy = {node: names for node, names in workloads.items() if names}
    if busy and drain == PartitionChange.Drain.WAIT:
        listed = "; ".join(f"{node}: {', '.join(names)}" for node, names in sorted(busy.items()))
        raise Invalid("drain", f"Work is running on pool {pool.name} ({listed}). Wait for it to finish, or apply with drain=preempt "
                      "to checkpoint and preempt it.")
    try:
        with transaction.atomic():
            change = PartitionChange.objects.create(pool=pool, profile=profile, drain=drain, created_by=actor)
            record("partition_change.requested", actor=actor, obj=change, object_repr=_change_repr(change),
                   before={"profile": pool.partition_profile.name if pool.partition_profile else None},
                   after={"profile": profile.name, "pool": pool.name, "drain": drain})
            enqueue_on_commit("runners.tasks.partition_apply", change.id)
    except IntegrityError:
        raise Invalid("profile", f"Pool {pool.name} is already being re-partitioned; wait for that to finish.") from None
    return change
