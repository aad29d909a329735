"""The scheduler cycle: one transaction that snapshots the queue, quotas and inventory, asks the pure
scheduler, and writes every decision.

- One cycle at a time, cluster-wide: a transaction-level advisory lock. A cycle that waits for
  the lock runs after the first commits and sees its admissions, so the same capacity is never admitted twice. The beat's periodic cycle
  does not wait: it tries the lock and, when another cycle holds it, skips (logged, and the task
  says so); the next period's cycle does the same work. So two beats, or many workers, never
  line up behind one slow cycle. A kick (a submit, a finish) waits, since the cycle running may
  have started before what it is for, but returns at once when a cycle that started after the
  kick has committed meanwhile. The lock goes with the transaction: a worker that dies mid-cycle
  loses its connection, PostgreSQL rolls the cycle back and frees the lock, and the next
  period's cycle, on any worker, takes over.
- Admission (``runners.scheduler.admission.decide``) counts units per flavor against
  guarantees, max and fair share, and picks preemption victims; placement
  (``runners.scheduler.batch.place_queue``, over ``placement.place_gangs``) then finds GPUs for
  every admitted gang, whole, on free GPUs of the inventory (what holding attempts use is taken
  out first), inside the topology asked for, scored against the typical pods of the flavor's
  latest submissions. A gang admitted but not placeable waits with placement's reason. Each gang
  carries the bytes of its data (its datasets' shards, a serving replica's weights) that every
  node's cache holds now (`runners.nodecache.selectors.bytes_held`), and placement prefers the
  nodes holding more among placements it finds otherwise as good (runners.scheduler.placement).
- Launches and stops are sent after commit, so a worker never acts on a rolled-back decision.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from datetime import timezone as dt_timezone

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from audit.services import SCHEDULER, record
from common import metrics
from common.dispatch import send_tasks
from quotas.models import BorrowingPause, PartitionKind, Quota, ResourceFlavor
from runners.clusters.models import Gpu, Node
from runners.clusters.services import nodes_locked_unschedulable
from runners.datasets.selectors import UnknownDataset, blobs_for_job_spec
from runners.jobs.attempts import job_preempt_locked, jobs_admit_locked, open_attempts
from runners.jobs.models import JOB_HOLDING_STATES, Job, JobAttempt, JobState
from runners.jobs.services import DOMAIN_FIELDS, gang_misfit, job_rows_update, jobs_locked, send_job_stop
from runners.nodecache.selectors import bytes_held
from runners.scheduler import model as placement_model
from runners.scheduler.admission import (
    AdmissionSnapshot,
    FlavorQuota,
    PendingGang,
    RunningWorkload,
    TenantQuota,
    decide,
)
from runners.scheduler.batch import place_queue
from runners.scheduler.policies import FragModel, OnlineMix, TypicalPod, prior_pod, typical_pods
from runners.scheduling import defrag
from runners.scheduling.models import SchedulerCycle
from tenants.models import Tenant

logger = logging.getLogger(__name__)

# The cycle's transaction-level advisory lock key: "portal" in ASCII.
CYCLE_LOCK_KEY = 0x706F7274616C


def cycle_ran_since(moment_s: float) -> bool:
    """Whether a cycle started at or after this time (so it saw everything committed before it)."""
    started = SchedulerCycle.objects.filter(id=1).values_list("last_started_at", flat=True).first()
    return started is not None and started.timestamp() >= moment_s


def _lock(*, wait: bool = True, unless_ran_since: float | None = None) -> str:
    """Take the cycle's lock for this transaction and count the run; returns "" when this cycle runs,
    or why it does not: "busy" (``wait`` False and another cycle holds the lock) or "ran" (once the
    lock is ours, a cycle that started at or after ``unless_ran_since`` had committed meanwhile).
    """
    with connection.cursor() as cursor:
        if wait:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [CYCLE_LOCK_KEY])
        else:
            cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [CYCLE_LOCK_KEY])
            if not cursor.fetchone()[0]:
                return "busy"
    if unless_ran_since is not None and cycle_ran_since(unless_ran_since):
        return "ran"
    SchedulerCycle.objects.get_or_create(id=1)
    SchedulerCycle.objects.filter(id=1).update(runs=F("runs") + 1, last_started_at=timezone.now())
    return ""


# --- The inventory, as the cycle reads it -------------------------------------------------


@dataclass(frozen=True)
class _GpuRow:
    """One GPU's fields that placement reads, as `Gpu` has them (the MIG layout only of a MIG GPU)."""

    index: int
    model: str
    memory_mib: int
    partition_kind: str
    mig_layout: list
    timeslice_replicas: int


@dataclass(frozen=True)
class _NodeRow:
    """One schedulable node's fields that placement reads, as `Node` has them, with its GPUs by index."""

    name: str
    cpu_milli: int
    memory_mib: int
    rack: str
    block: str
    nvlink_domain: str
    schedulable: bool
    gpus: tuple[_GpuRow, ...]
    models: frozenset[str]  # the models of its GPUs


def _inventory() -> list[_NodeRow]:
    """The schedulable nodes by name, each with its GPUs by index: two queries of plain rows.

    Model instances cost more than everything else the cycle does with them on a large cluster
    (20,000 nodes and 100,000 GPUs: seconds), and the cycle only reads these fields.
    """
    # Only a MIG GPU's layout is ever read (by MIG flavors): fetched for those alone, since decoding
    # a JSON list for each of 100,000 GPUs costs as much as the rest of the query.
    mig_layouts = dict(
        Gpu.objects.filter(node__schedulable=True, partition_kind=PartitionKind.MIG).values_list("id", "mig_layout")
    )
    gpus: dict[int, list[_GpuRow]] = defaultdict(list)
    for gpu_id, node_id, index, model, memory_mib, kind, replicas in (
        Gpu.objects.filter(node__schedulable=True).order_by("node_id", "index")
        .values_list("id", "node_id", "index", "model", "memory_mib", "partition_kind", "timeslice_replicas")
    ):
        gpus[node_id].append(_GpuRow(index, model, memory_mib, kind, mig_layouts.get(gpu_id, []), replicas))
    nodes = []
    for node_id, *fields in (
        Node.objects.filter(schedulable=True).order_by("name")
        .values_list("id", "name", "cpu_milli", "memory_mib", "rack", "block", "nvlink_domain", "schedulable")
    ):
        its = tuple(gpus.get(node_id, ()))
        nodes.append(_NodeRow(*fields, gpus=its, models=frozenset(gpu.model for gpu in its)))
    return nodes


def _gpus_of(node) -> Sequence:
    """A node's GPUs: an inventory row's, or a `Node`'s (prefetched)."""
    return node.gpus if isinstance(node, _NodeRow) else list(node.gpus.all())


# --- The placement snapshot -----------------------------------------------------------


@dataclass
class _Usage:
    """What holding attempts use on one node."""

    cpu_milli: int = 0
    memory_mib: int = 0
    whole: set[int] = field(default_factory=set)  # GPU indices taken whole
    shares: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # GPU index -> time-slice shares
    mig: set[tuple[int, int]] = field(default_factory=set)  # (GPU index, instance start)

    def take(self, job: Job, replica: dict) -> None:
        """Count one replica of the job, placed on this node."""
        self.cpu_milli += job.spec["cpu_milli_per_replica"]
        self.memory_mib += job.spec["memory_mib_per_replica"]
        if replica.get("mig_profile"):
            self.mig.add((replica["gpus"][0], replica["mig_start"]))
        elif job.flavor.kind == PartitionKind.TIMESLICE:
            for index in replica["gpus"]:
                self.shares[index] += 1
        else:
            self.whole.update(replica["gpus"])


# What a node nothing holds uses; read, never changed.
_NO_USAGE = _Usage()


def _usage(holding: list[Job], attempts: dict[int, JobAttempt]) -> dict[str, _Usage]:
    used: dict[str, _Usage] = defaultdict(_Usage)
    for job in holding:
        attempt = attempts.get(job.id)
        for replica in attempt.placement if attempt else ():
            used[replica["node"]].take(job, replica)
    return used


def _flavor_gpus(flavor: ResourceFlavor, gpus: Sequence) -> list:
    return [
        gpu for gpu in gpus
        if gpu.model == flavor.gpu_model and gpu.partition_kind == flavor.kind
        and (flavor.kind != PartitionKind.MIG or any(profile == flavor.mig_profile for profile, _ in gpu.mig_layout))
    ]


def _snapshot_for(flavor: ResourceFlavor, nodes: list[_NodeRow], used: dict[str, _Usage],
                  bare: dict[str, placement_model.Node] | None = None):
    """The cluster as placement sees it for one flavor: only that flavor's GPUs, what is used taken out.

    ``bare``: snapshot nodes already made, without GPUs and with nothing used, by name; a node that
    is so for this flavor too is taken from there (and added), not made again for every flavor.

    Returns the snapshot, per node the real GPU index of each snapshot GPU, and the milli-GPU
    share a time-slice replica asks for (the GPU cut into the fewest replicas sets it).
    """
    snapshot_nodes, index_maps, fewest_replicas = [], {}, None
    for node in nodes:
        usage = used.get(node.name) or _NO_USAGE
        if isinstance(node, _NodeRow) and flavor.gpu_model not in node.models:
            gpus = []  # most nodes of a large cluster, for any one flavor
            if bare is not None and usage is _NO_USAGE:
                if node.name not in bare:
                    bare[node.name] = placement_model.Node(
                        name=node.name, cpu_milli=node.cpu_milli, memory_mib=node.memory_mib, gpus=[],
                        rack=node.rack or None, block=node.block or None, schedulable=node.schedulable,
                    )
                index_maps[node.name] = []
                snapshot_nodes.append(bare[node.name])
                continue
        else:
            gpus = _flavor_gpus(flavor, _gpus_of(node))
        model_gpus = []
        for gpu in gpus:
            fewest_replicas = min(fewest_replicas or gpu.timeslice_replicas, gpu.timeslice_replicas)
            if flavor.kind == PartitionKind.MIG:
                instances = [
                    placement_model.MigInstance(profile, start, pod="held" if (gpu.index, start) in usage.mig else None)
                    for profile, start in gpu.mig_layout
                ]
                model_gpus.append(placement_model.Gpu(gpu.model, gpu.memory_mib, nvlink_domain=node.nvlink_domain or None,
                                                      mig_instances=instances))
            elif flavor.kind == PartitionKind.TIMESLICE:
                share = placement_model.GPU_MILLI // max(1, gpu.timeslice_replicas)
                free = placement_model.GPU_MILLI - share * usage.shares.get(gpu.index, 0)
                model_gpus.append(placement_model.Gpu(gpu.model, gpu.memory_mib, free_milli=max(0, free),
                                                      nvlink_domain=node.nvlink_domain or None))
            else:
                free = 0 if gpu.index in usage.whole else placement_model.GPU_MILLI
                model_gpus.append(placement_model.Gpu(gpu.model, gpu.memory_mib, free_milli=free,
                                                      nvlink_domain=node.nvlink_domain or None))
        index_maps[node.name] = [gpu.index for gpu in gpus]
        snapshot_nodes.append(
            placement_model.Node(
                name=node.name, cpu_milli=node.cpu_milli, memory_mib=node.memory_mib, gpus=model_gpus,
                rack=node.rack or None, block=node.block or None, schedulable=node.schedulable,
                cpu_used_milli=min(usage.cpu_milli, node.cpu_milli), memory_used_mib=min(usage.memory_mib, node.memory_mib),
            )
        )
    return placement_model.Snapshot(tuple(snapshot_nodes)), index_maps, placement_model.GPU_MILLI // max(1, fewest_replicas or 1)


def _pod(flavor: ResourceFlavor, timeslice_share: int, name: str, cpu_milli: int, memory_mib: int,
         gpus_per_replica: int) -> placement_model.PodRequest:
    """One replica of a job of this flavor, as placement sees it."""
    common = dict(name=name, cpu_milli=cpu_milli, memory_mib=memory_mib, gpu_models=frozenset({flavor.gpu_model}))
    if flavor.kind == PartitionKind.MIG:
        return placement_model.PodRequest(**common, mig_profile=flavor.mig_profile)
    if flavor.kind == PartitionKind.TIMESLICE:
        return placement_model.PodRequest(**common, num_gpu=1, gpu_milli=timeslice_share)
    return placement_model.PodRequest(**common, num_gpu=gpus_per_replica, gpu_milli=placement_model.GPU_MILLI)


def _gang(job: Job, timeslice_share: int, cached_bytes: dict[str, int] | None = None) -> placement_model.Gang:
    spec, flavor = job.spec, job.flavor
    pods = tuple(
        _pod(flavor, timeslice_share, f"{job.id}-{rank}", spec["cpu_milli_per_replica"], spec["memory_mib_per_replica"],
             job.gpus_per_replica)
        for rank in range(job.replicas)
    )
    topology = spec["topology"]
    return placement_model.Gang(str(job.id), pods, topology=topology["level"], required=topology["mode"] == "required",
                                cached_bytes=cached_bytes or {})


def _job_blobs(job: Job, shards_of: dict) -> tuple[str, ...]:
    """The sha256 of every blob a job reads: its datasets' shards (access checked) and a serving replica's
    model weights (its spec, built by the inference app from the endpoint's model version).

    ``shards_of`` remembers each (tenant, datasets) asked within the cycle: a team's jobs often read the
    same versions. A dataset the job may no longer read (deleted, or no longer shared) adds nothing
    here: placement only loses a preference, and the launch says what is wrong."""
    blobs: dict[str, None] = {}
    named = job.spec.get("datasets")
    if named:
        key = (job.tenant_id, tuple((entry["name"], entry["version"]) for entry in named))
        if key not in shards_of:
            try:
                shards_of[key] = tuple(sha256 for sha256, _ in blobs_for_job_spec(job.tenant, job.spec))
            except UnknownDataset:
                shards_of[key] = ()
        blobs.update(dict.fromkeys(shards_of[key]))
    weights = (job.spec.get("serving") or {}).get("weights")
    if weights:
        blobs[weights["sha256"]] = None
    return tuple(blobs)


def _cached_bytes(jobs: list[Job], node_names: list[str]) -> dict[int, dict[str, int]]:
    """For each job that reads blobs, the bytes of them each of these nodes' caches holds (nodes holding
    none left out): what placement prefers among placements otherwise as good (runners.scheduler.placement).
    One query per distinct set of blobs, not per job."""
    held: dict[int, dict[str, int]] = {}
    shards_of: dict = {}
    by_blobs: dict[tuple[str, ...], dict[str, int]] = {}
    for job in jobs:
        blobs = _job_blobs(job, shards_of)
        if not blobs or not node_names:
            continue
        if blobs not in by_blobs:
            by_blobs[blobs] = {name: count for name, count in bytes_held(node_names, blobs).items() if count}
        held[job.id] = by_blobs[blobs]
    return held


# How many of a flavor's latest submissions the cycle learns the typical pods from.
RECENT_SUBMISSIONS = 500


def _recent_typical(flavor: ResourceFlavor, timeslice_share: int,
                    snapshot: placement_model.Snapshot) -> list[TypicalPod] | None:
    """The flavor's typical pods, learnt from its latest submissions (whatever became of them), on top
    of `prior_pod` as `OnlineMix` does in the replay; None for MIG, which FGD does not score."""
    if flavor.kind == PartitionKind.MIG:
        return None
    mix = OnlineMix([prior_pod(snapshot.nodes)], with_memory=True)
    recent = (Job.objects.filter(flavor=flavor).order_by("-submitted_at", "-id")
              .values_list("replicas", "gpus_per_replica", "spec__cpu_milli_per_replica", "spec__memory_mib_per_replica")
              [:RECENT_SUBMISSIONS])
    for replicas, gpus, cpu, memory in recent:
        pod = _pod(flavor, timeslice_share, "recent", int(cpu or 0), int(memory or 0), gpus)
        for _ in range(replicas):
            mix.see(pod)
    return mix.typical()


def _pins_free(pinned: list[Job], holding_pinned: list[Job], nodes: list[_NodeRow],
               used: dict[str, _Usage]) -> dict[int, list[dict]]:
    """The queued pinned jobs whose place is free now (of holding attempts and every other pin), with it; then
    every live pin, of queued and holding (moved, still stopping) jobs alike, is taken out of ``used`` for
    the rest of the cycle."""
    by_name = {node.name: node for node in nodes}
    pins = [*pinned, *holding_pinned]
    free: dict[int, list[dict]] = {}
    for job in pinned:
        if all(_pin_fits(job, node, replicas, used, [other for other in pins if other.id != job.id])
               for node, replicas in _by_node(job.pinned_placement, by_name)):
            free[job.id] = job.pinned_placement
    for job in pins:
        for replica in job.pinned_placement:
            used[replica["node"]].take(job, replica)
    return free


def _by_node(pin: list[dict], by_name: dict) -> list[tuple]:
    """A pin's replicas grouped by node, each node's inventory row (None: gone or cordoned)."""
    grouped: dict[str, list[dict]] = defaultdict(list)
    for replica in pin:
        grouped[replica["node"]].append(replica)
    return [(by_name.get(name), replicas) for name, replicas in grouped.items()]


def _pin_fits(job: Job, node: _NodeRow | None, replicas: list[dict], used: dict[str, _Usage], others: list[Job]) -> bool:
    """Whether these replicas of the job fit on the node beside what holding attempts and the other pins use."""
    if node is None:
        return False
    base = used.get(node.name) or _NO_USAGE
    pinned, mine = _Usage(), _Usage()
    for other in others:
        for replica in other.pinned_placement:
            if replica["node"] == node.name:
                pinned.take(other, replica)
    for replica in replicas:
        mine.take(job, replica)
    if (base.cpu_milli + pinned.cpu_milli + mine.cpu_milli > node.cpu_milli
            or base.memory_mib + pinned.memory_mib + mine.memory_mib > node.memory_mib):
        return False
    gpus = {gpu.index: gpu for gpu in _flavor_gpus(job.flavor, _gpus_of(node))}
    if not (mine.whole | mine.shares.keys()) <= gpus.keys():
        return False
    if job.flavor.kind == PartitionKind.TIMESLICE:
        return all(base.shares.get(index, 0) + pinned.shares.get(index, 0) + count <= gpus[index].timeslice_replicas
                   for index, count in mine.shares.items())
    return not mine.whole & (base.whole | pinned.whole)


def _one_pod(job: Job, timeslice_share: int) -> placement_model.PodRequest | None:
    """The job as one pod on one node (all its replicas' GPUs, CPU and memory), which meets any topology it asks
    for; None where the planner makes no room: a MIG flavor, or several time-slice replicas (each needs a GPU
    of its own)."""
    flavor, spec = job.flavor, job.spec
    if flavor.kind == PartitionKind.MIG or (flavor.kind == PartitionKind.TIMESLICE and job.replicas > 1):
        return None
    return _pod(flavor, timeslice_share, str(job.id), spec["cpu_milli_per_replica"] * job.replicas,
                spec["memory_mib_per_replica"] * job.replicas, job.units)


def _rooms(unplaced: list[Job], nodes: list[_NodeRow], used: dict[str, _Usage], holding: list[Job],
           attempts: dict[int, JobAttempt], spared: set[int], now) -> list[defrag.PlannedRoom]:
    """Rooms for the admitted jobs that fit on no node, flavor by flavor, within the budget."""
    rooms: list[defrag.PlannedRoom] = []
    # Nothing may move (a quick look at the jobs' own fields): no snapshot to build, no planner to ask.
    recently = defrag.moved_recently(now)
    if not any(defrag.may_move(job, recently=recently, spared=spared) for job in holding):
        return rooms
    budget = defrag.budget_left_gpu_s(holding, now)
    by_flavor: dict[int, list[Job]] = defaultdict(list)
    for job in unplaced:
        by_flavor[job.flavor_id].append(job)
    for jobs in by_flavor.values():
        flavor = jobs[0].flavor
        if budget <= 0 or flavor.kind == PartitionKind.MIG:
            continue
        snapshot, index_maps, share = _snapshot_for(flavor, nodes, used)
        found, budget = defrag.plan_rooms(
            flavor=flavor, waiting=jobs, snapshot=snapshot, index_maps=index_maps, holding=holding, attempts=attempts,
            pod_of=lambda job, rank, share=share: _gang(job, share).pods[rank],
            waiting_pod=lambda job, share=share: _one_pod(job, share), recently=recently, spared=spared,
            budget_gpu_s=budget,
        )
        rooms.extend(found)
    return rooms


def _place(admitted: list[Job], nodes: list[_NodeRow], used: dict[str, _Usage]) -> dict[int, list[dict] | str]:
    """Placement for each admitted job (a list of replicas), or the reason it does not fit now."""
    results: dict[int, list[dict] | str] = {}
    layouts = {}
    if any(job.flavor.kind == PartitionKind.MIG for job in admitted):
        # Only MIG replicas are checked against the layout.
        layouts = {
            (node.name, gpu.index): [list(instance) for instance in gpu.mig_layout] for node in nodes for gpu in _gpus_of(node)
        }
    by_flavor: dict[int, list[Job]] = defaultdict(list)
    for job in admitted:
        by_flavor[job.flavor_id].append(job)
    bare: dict[str, placement_model.Node] = {}
    for jobs in by_flavor.values():
        flavor = jobs[0].flavor
        snapshot, index_maps, share = _snapshot_for(flavor, nodes, used, bare)
        # Each job's bytes already in the node caches of this flavor's nodes, as the caches' rows say now.
        held = _cached_bytes(jobs, [name for name, gpus in index_maps.items() if gpus])
        gangs = [_gang(job, share, held.get(job.id)) for job in jobs]
        # Both orders (admission's and largest first) are tried; see runners.scheduler.batch.place_queue.
        decisions = place_queue(snapshot, gangs, typical=_recent_typical(flavor, share, snapshot))
        for job, decision in zip(jobs, decisions):
            if not decision.placed:
                results[job.id] = f"Waiting: {decision.reason}."
                continue
            replicas = []
            for rank, placement in enumerate(decision.placements):
                real = [index_maps[placement.node][col] for col in placement.gpu_indices]
                replica = {"replica": rank, "node": placement.node, "gpus": real}
                if placement.mig_profile:
                    replica.update(mig_profile=placement.mig_profile, mig_start=placement.mig_start)
                replicas.append(replica)
            carved = [
                replica for replica in replicas if replica.get("mig_profile")
                and [replica["mig_profile"], replica["mig_start"]] not in layouts.get((replica["node"], replica["gpus"][0]), [])
            ]
            if carved:
                # The GPU Operator's layout is fixed by the pool's profile: a job takes an existing instance.
                results[job.id] = (f"Waiting: no idle {flavor.mig_profile} MIG instance is free for each of its "
                                   "replicas now.")
                continue
            results[job.id] = replicas
            # Later flavors' snapshots see what this one took (CPU, memory, these GPUs).
            for replica in replicas:
                used[replica["node"]].take(job, replica)
    return results


# --- The cycle ---------------------------------------------------------------------


def _epoch(moment) -> float:
    return moment.timestamp() if moment else 0.0


def _moment(epoch_s: float | None) -> datetime | None:
    """An epoch time of the pure scheduler as a datetime, to the second (a stored time, never text)."""
    return None if epoch_s is None else datetime.fromtimestamp(round(epoch_s), tz=dt_timezone.utc)


def _duration_text(seconds: float) -> str:
    """A span in words: '45 seconds', '2 minutes', '1 hour'."""
    for size, unit in ((3600, "hour"), (60, "minute"), (1, "second")):
        if seconds >= size or unit == "second":
            count = max(0, round(seconds / size))
            return f"{count} {unit}{'' if count == 1 else 's'}"
    return ""


def _preemption_reason(victim: Job, claimant: Job, why: str) -> str:
    """A victim's reason: whose job it makes room for, by name (no link: the reader cannot open another
    tenant's job), why, and what happens next. The deadline is the job's stop_deadline, not text."""
    within = _duration_text(settings.PREEMPTION_GRACE_PERIOD_S)
    if victim.kind == Job.Kind.SERVING:
        then = f"It was asked to drain and stop within {within}; then it waits in the queue to start again."
    else:
        then = (f"It was asked to checkpoint and stop within {within}; then it waits in the queue and resumes from "
                "its newest checkpoint.")
    return f"Preempted for job {claimant.name} of tenant {claimant.tenant.slug}: {why}. {then}"


def _units_per_node(flavor: ResourceFlavor, nodes: list[Node]) -> dict[str, int]:
    """Units of the flavor each of these nodes offers, as placement sees its GPUs (`_flavor_gpus`): the count
    runners.clusters' flavor_units_per_node makes, from the nodes the cycle has loaded instead of a query."""
    per_node = {}
    for node in nodes:
        if isinstance(node, _NodeRow) and flavor.gpu_model not in node.models:
            continue
        gpus = _flavor_gpus(flavor, _gpus_of(node))
        if flavor.kind == PartitionKind.MIG:
            units = sum(1 for gpu in gpus for profile, _ in gpu.mig_layout if profile == flavor.mig_profile)
        elif flavor.kind == PartitionKind.TIMESLICE:
            units = sum(gpu.timeslice_replicas for gpu in gpus)
        else:
            units = len(gpus)
        if units:
            per_node[node.name] = units
    return per_node


def _misfits(queued: list[Job], nodes: list[_NodeRow]) -> dict[int, str]:
    """Queued jobs that could not be placed on the cluster as it is now even were it empty, with why.

    The submit check refuses such a job; this catches the cluster shrinking under one already queued
    (nodes removed or cordoned, a re-partitioning). They are left out of admission, so they hold
    nothing and preempt nobody; once the cluster grows back they are considered again.
    """
    per_flavor: dict[int, dict[str, int]] = {}
    seen: dict[tuple, tuple[str, str] | None] = {}
    domains: dict[str, dict[str, str]] = {}  # each node's NVLink domain or rack, by level, once a gang requires one
    reasons = {}
    for job in queued:
        topology = job.spec["topology"]
        key = (job.flavor_id, job.replicas, job.gpus_per_replica, topology["level"], topology["mode"])
        if key not in seen:
            if job.flavor_id not in per_flavor:
                per_flavor[job.flavor_id] = _units_per_node(job.flavor, nodes)
            level = topology["level"]
            if level in DOMAIN_FIELDS and level not in domains:
                domains[level] = {node.name: getattr(node, DOMAIN_FIELDS[level]) for node in nodes}
            seen[key] = gang_misfit(job.flavor, replicas=job.replicas, gpus_per_replica=job.gpus_per_replica,
                                    topology=topology, per_node=per_flavor[job.flavor_id],
                                    domains=domains.get(topology["level"]))
        if seen[key] is not None:
            reasons[job.id] = (
                f"Blocked: it cannot fit the cluster as it is now. {seen[key][1]} Cancel it and submit a smaller job, "
                "or leave it queued: it is considered again once the capacity comes back."
            )
    return reasons


def _with_tenant_and_flavor(jobs: list[Job], flavors: dict[int, ResourceFlavor]) -> list[Job]:
    """The jobs with their tenant and flavor set, one instance of each shared by all its jobs.

    What select_related gives, without a tenant and a flavor instance made for every row: with
    100,000 jobs queued that alone took seconds.
    """
    tenants = {tenant.id: tenant for tenant in Tenant.objects.filter(id__in={job.tenant_id for job in jobs})}
    missing = {job.flavor_id for job in jobs} - flavors.keys()
    if missing:  # a flavor made since the cycle read them
        flavors = {**flavors, **{flavor.id: flavor for flavor in ResourceFlavor.objects.filter(id__in=missing)}}
    for job in jobs:
        job.tenant = tenants[job.tenant_id]
        job.flavor = flavors[job.flavor_id]
    return jobs


def cycle_run(*, wait: bool = True, unless_ran_since: float | None = None) -> dict:
    """One scheduler cycle; returns what it decided, by job id.

    ``wait`` False: when another cycle holds the lock, return ``{"skipped": "busy"}`` at once.
    ``unless_ran_since``: return ``{"skipped": "ran"}`` when, once the lock is ours, a cycle that
    started at or after that moment (epoch seconds) has committed meanwhile.
    """

    started = time.perf_counter()
    with transaction.atomic():
        skipped = _lock(wait=wait, unless_ran_since=unless_ran_since)
        if skipped:
            logger.info("Scheduler cycle skipped: %s.", "another cycle holds the lock" if skipped == "busy"
                        else "a cycle that started after it was asked for has run")
            return {"skipped": skipped}
        now = timezone.now()
        flavors = {flavor.id: flavor for flavor in ResourceFlavor.objects.all()}
        tenants: dict[str, dict] = defaultdict(lambda: {"quotas": {}, "weight": 0.0, "max_priority": 0})
        paused = set(BorrowingPause.objects.values_list("tenant_id", flat=True))
        for quota in Quota.objects.select_related("tenant", "flavor"):
            entry = tenants[quota.tenant.slug]
            # Weight and priority cap are per flavor, as the quota and the submit check hold them. A
            # tenant whose borrowing is paused (a budget spent) is held to its guarantee.
            ceiling = quota.guaranteed if quota.tenant_id in paused else quota.max
            entry["quotas"][quota.flavor.name] = FlavorQuota(
                quota.guaranteed, ceiling, weight=float(quota.fair_share_weight) or None, max_priority=quota.max_priority
            )
            entry["weight"] = max(entry["weight"], float(quota.fair_share_weight))
            entry["max_priority"] = max(entry["max_priority"], quota.max_priority)
        holding = _with_tenant_and_flavor(list(Job.objects.filter(state__in=JOB_HOLDING_STATES)), flavors)
        attempts = open_attempts(holding)
        queued = _with_tenant_and_flavor(
            list(Job.objects.filter(state=JobState.QUEUED).order_by("submitted_at", "id")), flavors
        )
        # Pins (runners.scheduling.defrag): a queued job with a live one holds its units and is admitted at its
        # place once that is free; one that ran out is dropped, and its job queues as any other.
        pinned = [job for job in queued if defrag.pin_is_live(job, now)]
        pinned_ids = {job.id for job in pinned}
        expired = [job for job in queued if job.pinned_placement and job.id not in pinned_ids]
        # The schedulable inventory, for the fit check here and placement below.
        nodes = _inventory()
        misfits = _misfits([job for job in queued if job.id not in pinned_ids], nodes)
        running = [
            RunningWorkload(
                id=str(job.id), tenant=job.tenant.slug, units_by_flavor={job.flavor.name: job.units},
                priority=job.priority, preemptible=job.preemptible, started_at_s=_epoch(job.started_at or job.state_changed_at),
                estimated_runtime_s=float(job.spec["max_runtime_s"]),
                stopping_deadline_s=_epoch(job.stop_deadline) if job.state in (JobState.PREEMPTED, JobState.CANCELLING)
                else None,
            )
            for job in holding
        ] + [
            # Its units are kept for it: admission counts them as held (within its tenant's max, as when the
            # room was made or the job was moved), and never picks it as a victim.
            RunningWorkload(
                id=str(job.id), tenant=job.tenant.slug, units_by_flavor={job.flavor.name: job.units},
                priority=job.priority, preemptible=False, started_at_s=now.timestamp(),
                estimated_runtime_s=float(job.spec["max_runtime_s"]),
            )
            for job in pinned
        ]
        pending = [
            PendingGang(
                id=str(job.id), tenant=job.tenant.slug, units_by_flavor={job.flavor.name: job.units},
                priority=job.priority, submitted_at_s=_epoch(job.submitted_at),
                estimated_runtime_s=float(job.spec["max_runtime_s"]), preemptible=job.preemptible,
            )
            for job in queued if job.id not in misfits and job.id not in pinned_ids
        ]
        snapshot = AdmissionSnapshot(
            capacity_units_by_flavor={flavor.name: flavor.capacity for flavor in flavors.values()},
            tenants=tuple(
                TenantQuota(slug, entry["quotas"], weight=entry["weight"] or 1.0, max_priority=entry["max_priority"])
                for slug, entry in tenants.items()
            ),
            running=tuple(running),
            pending=tuple(pending),
        )
        decisions = decide(snapshot, now.timestamp(), grace_period_s=float(settings.PREEMPTION_GRACE_PERIOD_S))
        by_id = {str(job.id): job for job in [*holding, *queued]}

        admitted_jobs = [by_id[admission.gang_id] for admission in decisions.admitted]
        used = _usage(holding, attempts)
        pinned_placed = _pins_free(pinned, [job for job in holding if defrag.pin_is_live(job, now)], nodes, used)
        placed = _place(admitted_jobs, nodes, used)
        # Jobs admission let in that fit on no node: room made for them by moving running work, where the planner
        # finds it within the budget (runners.scheduling.defrag).
        unplaced = [job for job in admitted_jobs if isinstance(placed[job.id], str)]
        spared_victims = {int(preemption.workload_id) for preemption in decisions.preemptions}
        rooms = _rooms(unplaced, nodes, used, holding, attempts, spared_victims, now) if unplaced else []
        placed.update(pinned_placed)
        admitted_jobs = [job for job in pinned if job.id in pinned_placed] + admitted_jobs
        # The nodes placed on, re-read under their row locks: a cordon that committed since the inventory was
        # read wins, and one not yet committed waits for this commit (runners.clusters.services' note).
        cordoned = nodes_locked_unschedulable(
            {replica["node"] for job in admitted_jobs if not isinstance(placed[job.id], str) for replica in placed[job.id]})
        for job in admitted_jobs:
            if not isinstance(placed[job.id], str) and any(replica["node"] in cordoned for replica in placed[job.id]):
                placed[job.id] = "Waiting: a node it was placed on was cordoned meanwhile; placed again next cycle."

        stops, preempted, spared = [], Counter(), set()
        # Every job row this cycle will move, victims and admissions alike, locked at once in id order (as
        # every writer of several jobs takes them; after the nodes, as a cordon takes them), read fresh.
        victims = jobs_locked(
            [int(preemption.workload_id) for preemption in decisions.preemptions]
            + [job.id for job in admitted_jobs if not isinstance(placed[job.id], str)]
            + [move.job.id for room in rooms for move in room.moves] + [room.job.id for room in rooms]
        )
        for preemption in decisions.preemptions:
            # The victim's row, locked and read fresh: a launch claims an attempt under this lock,
            # so what the victim is doing now is known, and what is written depends on it. A victim
            # made non-preemptible meanwhile (promoted into its tenant's guarantee) is left alone,
            # and its claimant waits for the next cycle to decide again.
            victim = victims.get(int(preemption.workload_id))
            if victim is None:
                continue
            if not victim.preemptible:
                spared.add(preemption.for_gang_id)
                continue
            claimant = by_id[preemption.for_gang_id]
            before = victim.state
            reason = _preemption_reason(victim, claimant, preemption.reason)
            outcome = job_preempt_locked(victim, reason, now=now, only_preemptible=True)
            if outcome is not None:
                preempted[victim.tenant.slug] += 1
                record("job.preempted", actor=SCHEDULER, tenant=victim.tenant, obj=victim,
                       object_repr=f"{victim.name} #{victim.id}", before={"state": before},
                       # Whose job it made room for, as the victim's own reason names it (no id: the
                       # victim's admins cannot open another tenant's job).
                       after={"state": victim.state, "for_job": claimant.name, "for_tenant": claimant.tenant.slug,
                              "why": preemption.reason})
            if outcome == "stopping":
                stops.append(victim.id)

        for gang_id in spared:
            # Its room was to come from a victim that stays: it is not admitted on this cycle's count.
            if int(gang_id) in placed:
                placed[int(gang_id)] = ("Waiting: a job it was to take the place of has joined its tenant's guarantee "
                                        "meanwhile; the next cycle decides again.")
        room_stops, room_reasons = defrag.rooms_make(rooms, victims, now,
                                                     within=_duration_text(settings.PREEMPTION_GRACE_PERIOD_S))
        stops.extend(room_stops)
        for job_id, reason in room_reasons.items():
            placed[job_id] = reason
        waiting_reasons = {waiting.gang_id: waiting.reason for waiting in decisions.waiting}
        waiting_reasons.update({str(job_id): reason for job_id, reason in misfits.items()})
        starts = {reservation.gang_id: _moment(reservation.projected_start_s) for reservation in decisions.reservations}
        for job in admitted_jobs:
            if isinstance(placed[job.id], str):
                waiting_reasons[str(job.id)] = placed[job.id]
        # A pin is used once: the job is admitted at its place (or, one that ran out, wherever it was placed), and
        # the transition to admitted drops it.
        launches = jobs_admit_locked([job for job in admitted_jobs if not isinstance(placed[job.id], str)], placed)

        # Everyone still queued: the reason and the place in line, in the order the cycle considered them.
        # Jobs that cannot fit the cluster now are in no line until it grows back: no place, no start.
        line = [waiting.gang_id for waiting in decisions.waiting] + [
            str(job.id) for job in admitted_jobs if isinstance(placed[job.id], str)
        ]
        # Pinned jobs whose place is not free yet keep their reason (why room is being made, or the move's),
        # outside the line: their units are held already.
        kept = [job for job in pinned if job.id not in pinned_placed]
        waiting_reasons.update({str(job.id): job.reason for job in kept})
        order = line + [str(job.id) for job in kept] + [str(job_id) for job_id in misfits]
        updates = []
        for position, gang_id in enumerate(order, start=1):
            job = by_id[gang_id]
            reason, start = waiting_reasons.get(gang_id, "")[:1000], starts.get(gang_id)
            if position > len(line):
                position, start = None, None
            if job.state == JobState.QUEUED and (
                job.reason != reason or job.queue_position != position or job.projected_start != start
            ):
                job.reason, job.queue_position, job.projected_start = reason, position, start
                updates.append(job)
        # Never waited for: a row another writer holds (a cancel, a replica retired) is left to the next cycle.
        job_rows_update(updates, ["reason", "queue_position", "projected_start"], only_in_state=JobState.QUEUED,
                        skip_locked=True)
        # (One admitted in this cycle left queued, and its pin, at its transition: only_in_state skips it.)
        for job in expired:
            job.pinned_placement = job.pinned_until = None
        job_rows_update(expired, ["pinned_placement", "pinned_until"], only_in_state=JobState.QUEUED, skip_locked=True)
        elapsed_ms = (time.perf_counter() - started) * 1000
        SchedulerCycle.objects.filter(id=1).update(
            last_duration_ms=elapsed_ms, last_admitted=len(launches), last_preempted=len(stops),
            last_waiting=len(order),
        )
        if launches:
            # One message per launch, as ever (job_launch's arguments are unchanged), but all of them
            # sent together after commit: one connection, one round trip per thousand (`send_tasks`).
            # A launch whose message is lost (the broker down, this process dead after commit) is
            # not lost: the job stays admitted with its attempt open, and the reconcile sends its
            # launch again after JOB_LAUNCH_RESEND_AFTER_S (runners.jobs.reconcile).
            transaction.on_commit(lambda: send_tasks("runners.tasks.job_launch", launches))
        for job_id in stops:
            transaction.on_commit(lambda job_id=job_id: send_job_stop(job_id))
    # Counted after the cycle's transaction (committed: the task runs it in autocommit), so a cycle
    # that raised and rolled back counts nothing.
    metrics.cycle_recorded(
        duration_s=elapsed_ms / 1000, preempted=preempted,
        admitted=Counter(by_id[str(job_id)].tenant.slug for job_id, _ in launches),
    )
    return {
        "admitted": [job_id for job_id, _ in launches],
        "preempted": stops,
        "waiting": [int(gang_id) for gang_id in order],
        "duration_ms": elapsed_ms,
    }


# --- The cluster's fragmentation, as placement measures it ---------------------------------


def _one_unit(flavor: ResourceFlavor, share: int) -> placement_model.PodRequest:
    """A pod of one unit of the flavor: the typical pod of a flavor nothing runs on or waits for."""
    milli = placement_model.GPU_MILLI if flavor.kind == PartitionKind.WHOLE else share
    return placement_model.PodRequest(f"one-{flavor.name}", 0, 0, num_gpu=1, gpu_milli=milli, gpu_models=frozenset({flavor.gpu_model}))


def fragmentation_now() -> dict:
    """The cluster's GPU fragmentation now, measured as the scheduler's placement measures it.

    The scheduler places with fragmentation gradient descent (runners.scheduler.policies, the
    "portal" policy): it picks the node where `FragModel`, the expected fragmentation for the
    workload's typical pods, grows least. A node's free GPU capacity counts as fragmented for a
    typical pod that cannot use it (too little left on a GPU, or the node's CPU or memory gone),
    weighted by how often that pod shape appears. Here each whole or time-sliced flavor is measured
    on the snapshot the cycle places it on (the flavor's GPUs on schedulable nodes, less what
    holding attempts use: `_usage` and `_snapshot_for`, as the cycle takes it), with the pods of the work
    holding or waiting for it as the typical pods, as the cycle takes its own gangs' pods (and
    memory, as the portal policy does). The percentage is fragmented milli-GPUs over all of them,
    as the bench's replay reports it. MIG instances are fixed slots, outside the measure.
    """
    nodes = _inventory()
    work = list(Job.objects.filter(state__in=[*JOB_HOLDING_STATES, JobState.QUEUED]).select_related("flavor"))
    holding = [job for job in work if job.state != JobState.QUEUED]
    used = _usage(holding, open_attempts(holding))
    fragmented = total = 0.0
    for flavor in ResourceFlavor.objects.exclude(kind=PartitionKind.MIG).order_by("name"):
        snapshot, _, share = _snapshot_for(flavor, nodes, used)
        state = placement_model.ClusterState(list(snapshot.nodes))
        if not state.total_gpus:
            continue
        pods = [pod for job in work if job.flavor_id == flavor.id for pod in _gang(job, share).pods]
        fragmented += FragModel(state, typical_pods(pods or [_one_unit(flavor, share)], with_memory=True)).total()
        total += state.total_gpus * placement_model.GPU_MILLI
    return {"pct": 100 * fragmented / total if total else None, "gpus": total / placement_model.GPU_MILLI,
            "fragmented_gpus": fragmented / placement_model.GPU_MILLI}
