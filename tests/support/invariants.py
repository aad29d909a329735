"""The job path's invariants, checked at any moment from the database and the backend's own view.

``check(backend)`` returns the violations it finds (an empty list when every rule holds); each
message names the job, attempt, tenant, flavor or GPU it is about. The database is read in one
REPEATABLE READ snapshot, so rows written while the check runs cannot make two of
its reads disagree; the backend is read after it, and only for attempts that ended long enough
ago that no write in flight can explain what it shows.

The rules:

1. Attempts and states: a ``running`` job has exactly one open (``ended_at`` null), started
   attempt; a job in a holding state (JOB_HOLDING_STATES) has exactly one open attempt; a queued
   or final job has none.
2. No attempt's processes outlive it: an attempt that ended more than PREEMPTION_GRACE_PERIOD_S +
   ``slack_s`` ago has nothing running any more (the local backend: its supervisor; QuickJobs: its
   record; the Kubernetes stand-in: its pods).
3. No GPU is held twice by open attempts: a whole GPU by one replica; a MIG instance (GPU and
   instance start) by one replica, and never beside a whole-GPU replica; a time-sliced GPU by at
   most its ``timeslice_replicas`` shares.
4. No tenant holds more than its quota's max of a flavor, and no flavor is held past its
   capacity (units of holding jobs). Capacity lowered during the run (a lost node, a
   re-partition) does not count: the units are checked against the larger of the capacity now
   and the capacity in the ``baseline`` taken at the start.
5. Nothing is stuck: every job is final; or queued with a reason; or running (within its
   max_runtime_s plus ``stuck_after_s``); or in a state that waits on a message (admitted,
   launching, preempted, cancelling) for less than ``stuck_after_s`` since its state changed,
   its launch lease ran out or its stop deadline passed.
6. Deleted environments: no job of an environment being deleted (or deleted) waits in the
   queue or got an attempt after the delete, and no environment is deleted while an attempt of
   its jobs is open.
7. The ledger (``check_ledger``, also part of ``check``): for every attempt, the entries written
   plus what the ledger has not settled yet (``ledger.unwritten``) equal the hand formula: units x
   seconds x the price card in force, cut at UTC midnights and card starts, from its admission
   (clipped to the latest recorded end of the job's earlier attempts) to its end (none recorded:
   the next attempt's admission, else now); and no second is counted twice across a job's
   attempts (their GPU-seconds never exceed units x the union of their intervals).
8. Pins (the places kept by moves that make room, runners.scheduling.defrag): a job with a live
   pin (``pinned_until`` not past) is queued or preempted (admission uses the pin up); no GPU is
   kept by two pins; and a pinned GPU is held by no open attempt of another job but one already
   told to stop (the moved job that clears it), nor past its time-slice shares counting the pins.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Sum
from django.utils import timezone

from quotas.models import PartitionKind, PriceCard, Quota, ResourceFlavor
from runners.clusters.models import Gpu
from runners.environments.models import Environment, EnvironmentState
from runners.jobs.models import JOB_FINAL_STATES, JOB_HOLDING_STATES, Job, JobAttempt, JobState

# States that wait for a message (a launch, a stop) or the reconcile to move them on.
WAITING_STATES = (JobState.ADMITTED, JobState.LAUNCHING, JobState.PREEMPTED, JobState.CANCELLING)


@dataclass
class Baseline:
    """What the check compares against: the cluster as it was when the run started."""

    capacities: dict[str, int] = field(default_factory=dict)  # flavor name -> units
    timeslice_replicas: dict[tuple[str, int], int] = field(default_factory=dict)  # (node, GPU index) -> shares

    def learn(self, gpus) -> None:
        """Remember each time-sliced GPU's share count (a lost node's GPU rows go; its jobs may still hold them)."""
        for node, index, replicas in gpus:
            self.timeslice_replicas[(node, index)] = max(replicas, self.timeslice_replicas.get((node, index), 0))


def baseline() -> Baseline:
    """The capacities and GPUs now: take it once the cluster is set up, before the run."""
    taken = Baseline(capacities=dict(ResourceFlavor.objects.values_list("name", "capacity")))
    taken.learn(Gpu.objects.filter(partition_kind=PartitionKind.TIMESLICE)
                .values_list("node__name", "index", "timeslice_replicas"))
    return taken


@dataclass
class _Snapshot:
    now: object
    jobs: dict[int, Job]
    open_attempts: dict[int, list[JobAttempt]]
    ended_attempts: list[JobAttempt]
    quotas: dict[tuple[int, int], int]  # (tenant id, flavor id) -> max
    flavors: dict[int, ResourceFlavor]
    gpus: list[tuple[str, int, int]]
    environments: dict[int, Environment]


def _read(horizon_s: float) -> _Snapshot:
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        now = timezone.now()
        jobs = {job.id: job for job in Job.objects.exclude(state__in=JOB_FINAL_STATES).select_related("tenant", "flavor")}
        open_attempts: dict[int, list[JobAttempt]] = defaultdict(list)
        for attempt in JobAttempt.objects.filter(ended_at__isnull=True).select_related("job__tenant", "job__flavor"):
            open_attempts[attempt.job_id].append(attempt)
            # An open attempt of a final job: the job is read here too, so the rule can name it.
            jobs.setdefault(attempt.job_id, attempt.job)
        ended = list(JobAttempt.objects.filter(
            ended_at__isnull=False, ended_at__gte=now - timezone.timedelta(seconds=horizon_s)
        ).only("id", "job_id", "number", "ended_at", "outcome"))
        return _Snapshot(
            now=now, jobs=jobs, open_attempts=open_attempts, ended_attempts=ended,
            quotas={(tenant, flavor): cap for tenant, flavor, cap in Quota.objects.values_list("tenant_id", "flavor_id", "max")},
            flavors={flavor.id: flavor for flavor in ResourceFlavor.objects.all()},
            gpus=list(Gpu.objects.filter(partition_kind=PartitionKind.TIMESLICE)
                      .values_list("node__name", "index", "timeslice_replicas")),
            environments={env.id: env for env in Environment.objects.filter(
                state__in=[EnvironmentState.DELETING, EnvironmentState.DELETED])},
        )


def _name(job: Job) -> str:
    return f"job {job.id} ({job.tenant.slug}/{job.name}, {job.state})"


def _attempt(attempt: JobAttempt) -> str:
    return f"attempt {attempt.job_id}/{attempt.number}"


# --- 1. Attempts and states ---------------------------------------------------------------


def _attempts_match_states(snap: _Snapshot) -> list[str]:
    found = []
    for job in snap.jobs.values():
        opened = snap.open_attempts.get(job.id, [])
        numbers = ", ".join(str(a.number) for a in opened) or "none"
        if job.state == JobState.RUNNING:
            started = [a for a in opened if a.started_at is not None]
            if len(opened) != 1 or len(started) != 1:
                found.append(f"{_name(job)} is running with open attempts [{numbers}], "
                             f"{len(started)} of them started (wants exactly one, started)")
        elif job.state in JOB_HOLDING_STATES:
            if len(opened) != 1:
                found.append(f"{_name(job)} holds with open attempts [{numbers}] (wants exactly one)")
        elif opened:
            found.append(f"{_name(job)} has open attempts [{numbers}] (a {job.state} job holds none)")
    return found


# --- 2. Processes that outlive their attempt ------------------------------------------------


def _alive_in_backend(backend, attempt: JobAttempt) -> str | None:
    """What of this attempt still runs, in the backend's own view; None when nothing does."""
    from tests.support.backends import QuickJobs
    from tests.support.k8s_standin import KubernetesStandIn

    if isinstance(backend, KubernetesStandIn):
        from runners.backends.job_manifests import ATTEMPT_LABEL, JOB_LABEL

        pods = [pod for pod in backend.pods(**{JOB_LABEL: str(attempt.job_id), ATTEMPT_LABEL: str(attempt.number)})
                if (pod.get("status") or {}).get("phase") in ("Pending", "Running")]
        return f"pods {', '.join(pod['metadata']['name'] for pod in pods)}" if pods else None
    if isinstance(backend, QuickJobs):
        record = backend._read(attempt.job_id, attempt.number)
        if record and record.get("end") is None and time.time() - record["started"] < record["duration"]:
            return f"its QuickJobs record (started {time.time() - record['started']:.1f}s ago, not ended)"
        return None
    jobs = getattr(backend, "jobs", None)
    if jobs is not None and hasattr(jobs, "attempt_dir"):
        from runners.backends.local_jobs import _alive

        try:
            pid, _group = (jobs.attempt_dir(attempt.job_id, attempt.number) / "supervisor.pid").read_text().split()
        except (FileNotFoundError, ValueError):
            return None
        return f"supervisor pid {pid}" if _alive(int(pid)) else None
    return None  # a backend this check cannot look into


def _nothing_outlives(snap: _Snapshot, backend, slack_s: float) -> list[str]:
    if backend is None:
        return []
    cutoff = snap.now - timezone.timedelta(seconds=settings.PREEMPTION_GRACE_PERIOD_S + slack_s)
    found = []
    for attempt in snap.ended_attempts:
        if attempt.ended_at > cutoff:
            continue
        alive = _alive_in_backend(backend, attempt)
        if alive:
            ago = (snap.now - attempt.ended_at).total_seconds()
            found.append(f"{_attempt(attempt)} ended {attempt.outcome} {ago:.1f}s ago but {alive} still runs "
                         f"(grace {settings.PREEMPTION_GRACE_PERIOD_S}s + slack {slack_s}s)")
    return found


# --- 3. GPUs held twice ---------------------------------------------------------------


def _gpus_held_once(snap: _Snapshot, base: Baseline) -> list[str]:
    claims: dict[tuple[str, int], list[tuple[str, JobAttempt, int | None]]] = defaultdict(list)
    for attempts in snap.open_attempts.values():
        for attempt in attempts:
            kind = attempt.job.flavor.kind
            for replica in attempt.placement:
                for index in replica["gpus"]:
                    if replica.get("mig_profile"):
                        claims[(replica["node"], index)].append(("mig", attempt, replica.get("mig_start")))
                    elif kind == PartitionKind.TIMESLICE:
                        claims[(replica["node"], index)].append(("share", attempt, None))
                    else:
                        claims[(replica["node"], index)].append(("whole", attempt, None))
    found = []
    for (node, index), held in sorted(claims.items()):
        if len(held) < 2:
            continue
        who = ", ".join(f"{_attempt(a)} ({kind}{'' if start is None else f' @{start}'})" for kind, a, start in held)
        kinds = {kind for kind, _, _ in held}
        where = f"GPU {node}/{index}"
        if "whole" in kinds:
            found.append(f"{where} is held whole and by another replica too: {who}")
        elif kinds == {"mig"}:
            starts = [start for _, _, start in held]
            if len(starts) != len(set(starts)):
                found.append(f"{where}: one MIG instance held twice: {who}")
        elif kinds == {"share"}:
            limit = base.timeslice_replicas.get((node, index), 1)
            if len(held) > limit:
                found.append(f"{where} holds {len(held)} time-slice shares, past its {limit}: {who}")
        else:
            found.append(f"{where} is held as a MIG instance and as a time-slice share at once: {who}")
    return found


# --- 4. Quota max and capacity -------------------------------------------------------------


def _within_max_and_capacity(snap: _Snapshot, base: Baseline) -> list[str]:
    per_tenant: dict[tuple[int, int], list[Job]] = defaultdict(list)
    per_flavor: dict[int, list[Job]] = defaultdict(list)
    for job in snap.jobs.values():
        if job.state in JOB_HOLDING_STATES:
            per_tenant[(job.tenant_id, job.flavor_id)].append(job)
            per_flavor[job.flavor_id].append(job)
    found = []
    for (tenant_id, flavor_id), jobs in sorted(per_tenant.items()):
        held = sum(job.units for job in jobs)
        cap = snap.quotas.get((tenant_id, flavor_id), 0)
        if held > cap:
            found.append(f"tenant {jobs[0].tenant.slug} holds {held} units of {jobs[0].flavor.name}, past its max "
                         f"{cap}: jobs {', '.join(str(job.id) for job in sorted(jobs, key=lambda j: j.id))}")
    for flavor_id, jobs in sorted(per_flavor.items()):
        flavor = snap.flavors[flavor_id]
        limit = max(flavor.capacity, base.capacities.get(flavor.name, flavor.capacity))
        held = sum(job.units for job in jobs)
        if held > limit:
            found.append(f"flavor {flavor.name} is held {held} units, past its capacity {limit}: jobs "
                         f"{', '.join(str(job.id) for job in sorted(jobs, key=lambda j: j.id))}")
    return found


# --- 5. Stuck jobs ------------------------------------------------------------------------


def _nothing_stuck(snap: _Snapshot, stuck_after_s: float) -> list[str]:
    found = []
    for job in snap.jobs.values():
        if job.state in JOB_FINAL_STATES:
            continue
        if job.state == JobState.QUEUED:
            if not job.reason.strip():
                found.append(f"{_name(job)} waits in the queue with no reason")
            continue
        opened = snap.open_attempts.get(job.id, [])
        if job.state == JobState.RUNNING:
            started = min((a.started_at for a in opened if a.started_at), default=None)
            budget = job.spec["max_runtime_s"] + stuck_after_s
            if started and (snap.now - started).total_seconds() > budget:
                found.append(f"{_name(job)} has run {(snap.now - started).total_seconds():.0f}s, past max_runtime_s "
                             f"+ {stuck_after_s}s")
            continue
        moments = [job.state_changed_at, job.stop_deadline, *(a.launch_lease_until for a in opened)]
        since = max(moment for moment in moments if moment is not None)
        waited = (snap.now - since).total_seconds()
        if waited > stuck_after_s:
            found.append(f"{_name(job)} has waited {waited:.1f}s (since its state changed, its lease ran out or its "
                         f"stop deadline passed; the bound is {stuck_after_s}s): {job.reason[:200]}")
    return found


# --- 6. Deleted environments ------------------------------------------------------------


def _deleted_environments_hold_nothing(snap: _Snapshot) -> list[str]:
    found = []
    for job in snap.jobs.values():
        environment = snap.environments.get(job.environment_id)
        if environment is None:
            continue
        deleted_at = environment.delete_requested_at
        if job.state in (JobState.QUEUED, JobState.ADMITTED):
            found.append(f"{_name(job)} of environment {environment.id} ({environment.state} since "
                         f"{deleted_at}) is still {job.state}")
        for attempt in snap.open_attempts.get(job.id, []):
            if deleted_at is not None and attempt.admitted_at > deleted_at:
                found.append(f"{_attempt(attempt)} was admitted at {attempt.admitted_at}, after environment "
                             f"{environment.id} was deleted at {deleted_at}")
            if environment.state == EnvironmentState.DELETED:
                found.append(f"{_attempt(attempt)} is open but environment {environment.id} is deleted")
    return found


# --- 8. Pins --------------------------------------------------------------------------------


def _pins_keep_their_places(snap: _Snapshot, base: Baseline) -> list[str]:
    found = []
    kept: dict[tuple[str, int], list[Job]] = defaultdict(list)
    for job in snap.jobs.values():
        if not job.pinned_placement or job.pinned_until is None or job.pinned_until <= snap.now:
            continue
        if job.state not in (JobState.QUEUED, JobState.PREEMPTED):
            found.append(f"{_name(job)} keeps a live pin {json.dumps(job.pinned_placement)} (only queued or preempted "
                         "jobs may: admission uses it up)")
            continue
        for replica in job.pinned_placement:
            for index in replica["gpus"]:
                kept[(replica["node"], index)].append(job)
    held: dict[tuple[str, int], list[tuple[Job, bool]]] = defaultdict(list)
    for attempts in snap.open_attempts.values():
        for attempt in attempts:
            stopping = attempt.job.state in (JobState.PREEMPTED, JobState.CANCELLING)
            for replica in attempt.placement:
                for index in replica["gpus"]:
                    held[(replica["node"], index)].append((attempt.job, stopping))
    for (node, index), pinned in sorted(kept.items()):
        where = f"GPU {node}/{index}"
        names = ", ".join(_name(job) for job in pinned)
        others = [job for job, stopping in held.get((node, index), []) if not stopping and job.id not in {p.id for p in pinned}]
        if pinned[0].flavor.kind == PartitionKind.TIMESLICE:
            limit = base.timeslice_replicas.get((node, index), 1)
            if len(pinned) + len(others) > limit:
                found.append(f"{where}: {len(pinned)} pinned shares ({names}) and {len(others)} held by running work "
                             f"are past its {limit} shares")
        elif len(pinned) > 1:
            found.append(f"{where} is kept by two pins: {names}")
        elif others:
            found.append(f"{where} is kept for {names} but held by {', '.join(_name(job) for job in others)}, "
                         "which was not told to stop")
    return found


# --- 7. The ledger -------------------------------------------------------------------------

# What rounding may leave between the ledger (each piece kept to 0.001 GPU-second and 0.000001 of
# money) and the formula: far below anything a miscount would show (a second of one unit).
GPU_SECONDS_SLACK = Decimal("0.05")
COST_SLACK = Decimal("0.0001")


def _hand_interval(attempt: dict, siblings: list[dict], now) -> tuple:
    """[start, end) the formula counts an attempt for, written out here, not taken from the ledger."""
    start = attempt["admitted_at"]
    for earlier in siblings:
        if earlier["number"] < attempt["number"] and earlier["ended_at"] is not None:
            start = max(start, earlier["ended_at"])
    end = attempt["ended_at"]
    if end is None:
        later = [other["admitted_at"] for other in siblings if other["number"] > attempt["number"]]
        end = min(later) if later else now
    end = min(max(end, start), now)
    return start, end


def _hand_cost(units: int, start, end, cards: list[tuple]) -> tuple[Decimal, dict[str, Decimal]]:
    """Units x seconds, and per currency units x seconds x the card in force, cut at midnights and card starts."""
    cuts = {start, end}
    day = datetime(start.year, start.month, start.day, tzinfo=UTC) + timedelta(days=1)
    while day < end:
        cuts.add(day)
        day += timedelta(days=1)
    cuts |= {effective for effective, _, _ in cards if start < effective < end}
    bounds = sorted(cuts)
    gpu_seconds, cost = Decimal(0), defaultdict(Decimal)
    for a, b in zip(bounds, bounds[1:]):
        seconds = Decimal((b - a) // timedelta(microseconds=1)) / Decimal(10**6) * units
        gpu_seconds += seconds
        in_force = [card for card in cards if card[0] <= a]
        if in_force:
            _, price, currency = max(in_force, key=lambda card: card[0])
            cost[currency] += seconds * price / 3600
    return gpu_seconds, dict(cost)


def _union_seconds(intervals: list[tuple]) -> Decimal:
    total, reach = Decimal(0), None
    for start, end in sorted(intervals):
        start = start if reach is None else max(start, reach)
        if end > start:
            total += Decimal((end - start) // timedelta(microseconds=1)) / Decimal(10**6)
            reach = end
    return total


def check_ledger() -> list[str]:
    """Rule 7, read in one REPEATABLE READ snapshot: every attempt's ledger against the formula."""
    from runners.usage import ledger
    from runners.usage.models import UsageEntry

    nested = connection.in_atomic_block  # a test's own transaction: its view is one already
    with transaction.atomic():
        if not nested:
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        now = timezone.now()
        attempts = list(JobAttempt.objects.values(
            "id", "job_id", "number", "admitted_at", "ended_at", "job__replicas", "job__gpus_per_replica",
            "job__flavor_id", "job__tenant__slug", "job__name"))
        cards: dict[int, list[tuple]] = defaultdict(list)
        for flavor_id, effective, price, currency in PriceCard.objects.values_list(
                "flavor_id", "effective_from", "price_per_hour", "currency"):
            cards[flavor_id].append((effective, price, currency))
        counted: dict[str, list] = defaultdict(lambda: [Decimal(0), defaultdict(Decimal)])
        for item, currency, gpu, cost in (
            UsageEntry.objects.filter(item__startswith="attempt:").values_list("item", "currency")
            .annotate(gpu=Sum("gpu_seconds"), cost=Sum("cost")).order_by().values_list("item", "currency", "gpu", "cost")
        ):
            counted[item][0] += gpu
            counted[item][1][currency] += cost
        for piece in ledger.unwritten(now):
            if piece.item.startswith("attempt:"):
                counted[piece.item][0] += piece.gpu_seconds
                counted[piece.item][1][piece.currency] += piece.cost
    by_job: dict[int, list[dict]] = defaultdict(list)
    for attempt in attempts:
        by_job[attempt["job_id"]].append(attempt)
    found = []
    for job_id, siblings in sorted(by_job.items()):
        units = siblings[0]["job__replicas"] * siblings[0]["job__gpus_per_replica"]
        intervals, job_seconds = [], Decimal(0)
        for attempt in sorted(siblings, key=lambda a: a["number"]):
            start, end = _hand_interval(attempt, siblings, now)
            want_gpu, want_cost = _hand_cost(units, start, end, cards[attempt["job__flavor_id"]])
            got_gpu, got_cost = counted.get(f"attempt:{attempt['id']}", (Decimal(0), {}))
            name = (f"attempt {job_id}/{attempt['number']} (id {attempt['id']}, "
                    f"{attempt['job__tenant__slug']}/{attempt['job__name']}, {start:%m-%d %H:%M:%S} to {end:%m-%d %H:%M:%S})")
            if abs(got_gpu - want_gpu) > GPU_SECONDS_SLACK:
                found.append(f"{name} is counted {got_gpu:.3f} GPU-seconds; the formula says {want_gpu:.3f}")
            for currency in sorted(set(want_cost) | {c for c, v in got_cost.items() if v}):
                got, want = got_cost.get(currency, Decimal(0)), want_cost.get(currency, Decimal(0))
                if abs(got - want) > COST_SLACK:
                    found.append(f"{name} costs {got:.6f} {currency} in the ledger; the formula says {want:.6f}")
            job_seconds += got_gpu
            if attempt["admitted_at"] < end:
                intervals.append((attempt["admitted_at"], end))
        held = _union_seconds(intervals) * units
        if job_seconds > held + GPU_SECONDS_SLACK * len(siblings):
            found.append(f"job {job_id} is counted {job_seconds:.3f} GPU-seconds over its attempts, more than the "
                         f"{held:.3f} its units held: a second is counted twice")
    return found


def check(backend=None, *, stuck_after_s: float = 60.0, slack_s: float = 5.0, baseline: Baseline | None = None,
          horizon_s: float = 3600.0, ledger: bool = True) -> list[str]:
    """Every violation of the rules above, now; empty when all hold.

    ``backend``: the portal's backend (local, QuickJobs) or a KubernetesStandIn, for rule 2;
    None skips it. ``baseline``: from ``baseline()`` at the start (capacities, time-slice share
    counts); without one, today's capacities and GPUs are the measure. ``horizon_s``: how far back
    ended attempts are looked at for rule 2. ``ledger``: rule 7 too (its own snapshot).
    """
    snap = _read(horizon_s)
    base = baseline or Baseline(capacities={})
    base.learn(snap.gpus)
    return [
        *_attempts_match_states(snap),
        *_nothing_outlives(snap, backend, slack_s),
        *_gpus_held_once(snap, base),
        *_within_max_and_capacity(snap, base),
        *_nothing_stuck(snap, stuck_after_s),
        *_deleted_environments_hold_nothing(snap),
        *_pins_keep_their_places(snap, base),
        *(check_ledger() if ledger else []),
    ]


def describe(job_ids) -> str:
    """Each job's state, reason and attempts: what a failure message needs."""
    lines = []
    for job in Job.objects.filter(id__in=list(job_ids)).order_by("id"):
        attempts = "; ".join(
            f"{a.number}: {a.outcome or 'open'} admitted {a.admitted_at:%H:%M:%S.%f} "
            f"started {a.started_at and f'{a.started_at:%H:%M:%S.%f}'} ended {a.ended_at and f'{a.ended_at:%H:%M:%S.%f}'}"
            f" {a.reason[:80]} {json.dumps(a.placement)[:120]}"
            for a in job.attempts.order_by("number")
        )
        events = " -> ".join(f"{e.to_state}@{e.at:%H:%M:%S.%f}" for e in job.events.order_by("at", "id"))
        lines.append(f"job {job.id} {job.tenant.slug}/{job.name}: {job.state} ({job.reason[:150]}); attempts {attempts}; "
                     f"events {events}")
    return "\n".join(lines)
