"""Moves that make room: the scheduler cycle's use of the pure planner (runners.scheduler.defrag).

When a job that admission let in fits on no node (its GPUs are free, but scattered), the cycle asks the
planner for at most two moves of running work after which it fits on one node. A move stops a job the
way a preemption does (the grace period, a checkpoint) and keeps its new place for it, so it never waits
in the queue: it is admitted there as soon as it has stopped, and resumes at its checkpoint's step. The
node the moves clear is kept for the waiting job the same way. Both places are *pins*
(``Job.pinned_placement`` until ``Job.pinned_until``): while a pin holds, the cycle counts its GPUs as
taken for everyone else and admits its job there (``runners.scheduling.services``).

What may move: a running, preemptible training job of one replica (a share of a GPU or one whole GPU),
whose tenant allows moves (``Tenant.allow_moves``), not moved within ``DEFRAG_MOVE_WINDOW_S``, holding
no pin and not preempted by this cycle. Serving replicas and workspaces are never moved: they restart
cold, there is no step to resume.

The budget: the GPU-seconds moves are expected to cost (a move stops its units for its checkpoint,
stop and restore) in the last hour, this cycle's included, stay within ``DEFRAG_BUDGET`` of the
GPU-seconds the holding jobs hold in an hour. What a move costs is learnt per flavor from the moves
made before (from the move to the moved job's next start), ``DEFRAG_MOVE_COST_S`` until there are any.

A move never changes what a tenant holds (the job keeps its units of its flavor) and the waiting job
goes where the planner made room, on one node, which meets any topology it asks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings

from audit.services import SCHEDULER, record
from quotas.models import PartitionKind, ResourceFlavor
from runners.jobs.attempts import job_preempt_locked
from runners.jobs.models import Job, JobAttempt, JobState
from runners.scheduler import model as placement_model
from runners.scheduler.defrag import DEFRAG_MAX_MOVES_PER_POD, Placements, Running, apply_plan, plan_room
from runners.scheduling.models import JobMove

# How long a pin outlives the grace period: a stopped job's attempt is ended by the next reconcile pass and
# its admission is the cycle after; a pin not used by then is dropped and its job queues as any other.
PIN_SLACK_S = 300
# How many of a flavor's latest moves the cost estimate is learnt from.
COST_SAMPLES = 20
# Waiting jobs of one flavor the planner is asked about per cycle, first in admission's order: each ask costs
# a pass over the flavor's nodes, and a cycle may leave thousands unplaced.
ROOM_TRIES = 8


@dataclass(frozen=True)
class PlannedMove:
    """One job to move: from where, to where (its pin), and the job the room is for."""

    job: Job
    from_node: str
    pin: list[dict]


@dataclass(frozen=True)
class PlannedRoom:
    """The moves that make room for one waiting job, and the place (its pin) they make."""

    job: Job
    moves: tuple[PlannedMove, ...]
    pin: list[dict]
    gain: str
    cost_s: float  # per unit moved


def pin_is_live(job: Job, now) -> bool:
    return bool(job.pinned_placement) and job.pinned_until is not None and job.pinned_until > now


def pin_until(now):
    return now + timedelta(seconds=settings.PREEMPTION_GRACE_PERIOD_S + PIN_SLACK_S)


def move_cost_s(flavor: ResourceFlavor) -> float:
    """Seconds a move of this flavor is expected to stop its units: the mean, over the flavor's latest moves
    whose job has started again since, of the time from the move to that start; the setting until there is one."""
    spans = []
    for move in JobMove.objects.filter(flavor=flavor.name).order_by("-at")[:COST_SAMPLES]:
        started = (JobAttempt.objects.filter(job_id=move.job_id, admitted_at__gte=move.at, started_at__isnull=False)
                   .order_by("number").values_list("started_at", flat=True).first())
        if started is not None:
            spans.append((started - move.at).total_seconds())
    return sum(spans) / len(spans) if spans else float(settings.DEFRAG_MOVE_COST_S)


def budget_left_gpu_s(holding: list[Job], now) -> float:
    """GPU-seconds moves may still cost this hour: DEFRAG_BUDGET of an hour of what is held, less the last hour's moves."""
    allowed = settings.DEFRAG_BUDGET * sum(job.units for job in holding) * 3600
    spent = 0.0
    for units, cost_s in JobMove.objects.filter(at__gt=now - timedelta(hours=1)).values_list("units", "cost_s"):
        spent += units * cost_s
    return allowed - spent


def moved_recently(now) -> set[int]:
    """Jobs moved within DEFRAG_MOVE_WINDOW_S: none is moved again before it ends."""
    since = now - timedelta(seconds=settings.DEFRAG_MOVE_WINDOW_S)
    return set(JobMove.objects.filter(at__gt=since).values_list("job_id", flat=True))


def may_move(job: Job, *, recently: set[int], spared: set[int]) -> bool:
    """Whether the job may be moved now (the module's note says which may)."""
    return (job.state == JobState.RUNNING and job.preemptible and job.kind == Job.Kind.TRAINING and job.replicas == 1
            and job.tenant.allow_moves and job.id not in recently and job.id not in spared
            and not job.pinned_placement)


def _gain(job: Job, node: str) -> str:
    flavor = job.flavor
    if flavor.kind == PartitionKind.WHOLE:
        return (f"{job.units} whole {flavor.gpu_model} GPU{'' if job.units == 1 else 's'} free together on {node} "
                f"for a job of {job.units} that fitted on no node")
    return f"a {flavor.gpu_model} share free on {node} for a job that fitted on no GPU"


def plan_rooms(*, flavor: ResourceFlavor, waiting: list[Job], snapshot, index_maps: dict[str, list[int]],
               holding: list[Job], attempts: dict, pod_of, waiting_pod, recently: set[int], spared: set[int],
               budget_gpu_s: float) -> tuple[list[PlannedRoom], float]:
    """Rooms for these waiting jobs of one flavor, in their order, on the flavor's snapshot as the cycle
    left it; returns them and the budget left. ``pod_of(job, rank)``: a holding job's replica as placement
    sees it; ``waiting_pod(job)``: a waiting job as one pod on one node, or None when no room can be made for
    it. ``recently``: the jobs moved within the window (those this call moves are added). A job the planner
    finds nothing for, or whose moves would pass the budget, is left waiting."""
    if flavor.kind == PartitionKind.MIG or budget_gpu_s <= 0:
        return [], budget_gpu_s
    state = placement_model.ClusterState(list(snapshot.nodes))
    rows = {name: row for row, name in enumerate(state.node_names)}
    columns = {name: {index: col for col, index in enumerate(indices)} for name, indices in index_maps.items()}
    jobs_by_id: dict[int, Job] = {}
    running: list[Running] = []
    for job in holding:
        if job.flavor_id != flavor.id or job.id not in attempts:
            continue
        jobs_by_id[job.id] = job
        for replica in attempts[job.id].placement:
            node = replica["node"]
            if node not in rows or replica.get("mig_profile"):
                continue
            cols = tuple(columns[node][index] for index in replica["gpus"] if index in columns[node])
            key = job.id if job.replicas == 1 else (job.id, replica["replica"])
            running.append(Running(key, pod_of(job, replica["replica"]), rows[node], cols))
    placed = Placements(state, running)

    def movable(item: Running) -> bool:
        job = jobs_by_id.get(item.key) if isinstance(item.key, int) else None
        return job is not None and may_move(job, recently=recently, spared=spared)

    rooms: list[PlannedRoom] = []
    if not any(movable(item) for item in running):
        return rooms, budget_gpu_s
    cost_s = None
    for job in waiting[:ROOM_TRIES]:
        pod = waiting_pod(job)
        if pod is None:
            continue
        plan = plan_room(state, pod, placed, max_moves=DEFRAG_MAX_MOVES_PER_POD, movable=movable)
        if plan is None:
            continue
        cost_s = move_cost_s(flavor) if cost_s is None else cost_s
        units = sum(jobs_by_id[move.running.key].units for move in plan.moves)
        if units * cost_s > budget_gpu_s:
            continue
        budget_gpu_s -= units * cost_s
        apply_plan(state, pod, plan, placed, key=("room", job.id))
        node = state.node_names[plan.row]
        real = [index_maps[node][col] for col in plan.gpus]
        per = job.gpus_per_replica if flavor.kind == PartitionKind.WHOLE else 1
        pin = [{"replica": rank, "node": node, "gpus": real[rank * per:(rank + 1) * per]} for rank in range(job.replicas)]
        moves = []
        for move in plan.moves:
            mover = jobs_by_id[move.running.key]
            to_node = state.node_names[move.to_row]
            moves.append(PlannedMove(
                job=mover, from_node=state.node_names[move.running.row],
                pin=[{"replica": 0, "node": to_node, "gpus": [index_maps[to_node][col] for col in move.to_gpus]}],
            ))
            # Moved once in this cycle: never again in it.
            recently.add(mover.id)
        rooms.append(PlannedRoom(job=job, moves=tuple(moves), pin=pin, gain=_gain(job, node), cost_s=cost_s))
    return rooms, budget_gpu_s



def rooms_make(rooms: list[PlannedRoom], locked: dict[int, Job], now, *, within: str) -> tuple[list[int], dict[int, str]]:
    """Make the planned rooms, on job rows the cycle holds locked and has read fresh: each move preempts its
    job with the grace period and pins its new place, and the waiting job's place is pinned. A room whose
    jobs have moved on since the cycle read them (a mover no longer running or preemptible, the waiting job
    no longer queued) is not made. ``within``: the grace period in words, as preemption reasons say it.
    Returns the jobs to tell to stop (after commit) and the waiting jobs' reasons."""
    stops: list[int] = []
    reasons: dict[int, str] = {}
    until = pin_until(now)
    for room in rooms:
        movers = [locked.get(move.job.id) for move in room.moves]
        waiting = locked.get(room.job.id)
        if waiting is None or waiting.state != JobState.QUEUED or any(
            mover is None or mover.state != JobState.RUNNING or not mover.preemptible for mover in movers
        ):
            continue
        node = room.pin[0]["node"]
        for move, mover in zip(room.moves, movers):
            to_node = move.pin[0]["node"]
            reason = (f"Moved to make room: {room.gain}, for job {waiting.name} of tenant {waiting.tenant.slug}. "
                      f"It was asked to checkpoint and stop within {within}; then it resumes from that checkpoint "
                      f"on {to_node}, kept for it.")
            outcome = job_preempt_locked(mover, reason, now=now, only_preemptible=True)
            if outcome is None:
                continue
            Job.objects.filter(id=mover.id).update(pinned_placement=move.pin, pinned_until=until)
            JobMove.objects.create(job=mover, for_job=waiting, flavor=move.job.flavor.name, from_node=move.from_node,
                                   to_node=to_node, units=mover.units, cost_s=room.cost_s, gain=room.gain[:300])
            record("job.moved", actor=SCHEDULER, tenant=mover.tenant, obj=mover, object_repr=f"{mover.name} #{mover.id}",
                   before={"state": JobState.RUNNING, "node": move.from_node},
                   after={"state": mover.state, "node": to_node, "why": "moved to make room", "gain": room.gain,
                          "for_job": waiting.name, "for_tenant": waiting.tenant.slug})
            if outcome == "stopping":
                stops.append(mover.id)
        Job.objects.filter(id=waiting.id).update(pinned_placement=room.pin, pinned_until=until)
        count = len(room.moves)
        record("job.room_made", actor=SCHEDULER, tenant=waiting.tenant, obj=waiting,
               object_repr=f"{waiting.name} #{waiting.id}",
               after={"node": node, "jobs_moved": count, "gain": room.gain})
        reasons[waiting.id] = (
            f"Waiting: it fitted on no node, so room is being made for it on {node}: {count} running "
            f"job{'' if count == 1 else 's'} moved with a checkpoint to another node; it starts there once "
            f"{'it has' if count == 1 else 'they have'} stopped."
        )
    return stops, reasons
