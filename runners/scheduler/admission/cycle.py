"""The admission cycle, `decide`: which pending gangs start now, what is preempted for them, what is held.

`decide` is a pure function of an `AdmissionSnapshot` and the time. The rules:

- Order: gangs within their tenant's guarantee go first, then by the tenant's
  weighted dominant share (recomputed after every decision), then higher
  priority, then older submission, then id. Inputs are sorted first, so the
  order of the snapshot's tuples does not matter.
- A tenant's *committed* units are its running work (including work that is
  checkpointing before a preemption deadline, since it still holds the GPUs),
  what this cycle admitted for it, and what this cycle holds for its waiting
  gangs. Guarantee, max and share are all measured on committed units.
- Never past max: a gang is admitted only if committed + gang <= max in every
  flavor. A priority above the tenant's max_priority is clamped to it (the API
  rejects such input; clamping here keeps a stale row from jumping the queue).
- Within guarantee: admitted if the units are free and not held; otherwise it
  claims free units plus units of work already stopping, and preempts other
  tenants' borrowed work for the rest (see `preemption`). It starts in
  a later cycle, once the victims have stopped; its claim is held until then.
- Borrowing (past guarantee, up to max): only from idle capacity, i.e. free and
  not held for anyone. Borrowing never preempts. Non-preemptible gangs may not
  borrow at all, because borrowed work must stay reclaimable.
- Reservations: a gang within guarantee that still cannot start holds what is
  free of its need; so do the first `max_reservations` borrowing gangs blocked
  by capacity. Later gangs backfill in capacity nobody holds, or in held
  capacity when their estimated runtime ends before the holder's projected
  start (a hold whose start is unknown lends nothing).
- Preempted work keeps counting as used, for capacity, max and share, until it
  leaves the snapshot: it holds the GPUs until its deadline. Its units are
  promised to the claimant, so they are not preempted for twice.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional

from ..fairshare import gang_order_key, weighted_dominant_share
from .preemption import VictimChoice, choose_victims
from .types import (
    CAPACITY_RESERVATION,
    GUARANTEE_CLAIM,
    Admission,
    AdmissionSnapshot,
    Decisions,
    PendingGang,
    Preemption,
    Reservation,
    ReservationKind,
    RunningWorkload,
    TenantQuota,
    Waiting,
    WaitingKind,
)

# Long enough for a training job to write a checkpoint of a large model to shared storage.
DEFAULT_GRACE_PERIOD_S = 120.0


def decide(
    snapshot: AdmissionSnapshot,
    now_s: float,
    *,
    grace_period_s: float = DEFAULT_GRACE_PERIOD_S,
    max_reservations: int = 1,
) -> Decisions:
    """Decide admissions, preemptions and reservations for one scheduler cycle.

    grace_period_s is how long a victim has to checkpoint before it is stopped;
    max_reservations is how many borrowing gangs blocked by capacity may hold
    what is idle for themselves (gangs within guarantee always may).
    """
    if grace_period_s < 0:
        raise ValueError(f"grace_period_s must be >= 0, got {grace_period_s!r}")
    if max_reservations < 0:
        raise ValueError(f"max_reservations must be >= 0, got {max_reservations!r}")
    return _Cycle(snapshot, now_s, grace_period_s, max_reservations).run()


@dataclass
class _Hold:
    """Units held this cycle for one waiting gang (mutable bookkeeping, never returned)."""

    gang_id: str
    tenant: str
    kind: ReservationKind
    held_free_units: dict[str, int]
    pledged_stopping_units: dict[str, int]
    projected_start_s: Optional[float]
    borrowing: bool = False
    backfill_used_units: dict[str, int] = field(default_factory=dict)


@dataclass
class _StoppingPiece:
    """Units of one flavor that stopping work gives back at deadline_s, as far as no claimant has them yet."""

    deadline_s: float
    units: int


@dataclass(frozen=True)
class _Release:
    """Units that come back at time_s: running work's estimated end, or stopping work's deadline."""

    time_s: float
    units_by_flavor: Mapping[str, int]


class _TenantLine:
    """One tenant's candidate gangs, in the order `_order_key` takes them.

    Within one tenant the share is the same for every gang, so the order is: gangs within the
    guarantee first, then higher priority, older, id. Whether a gang borrows only ever goes from
    no to yes in a cycle (committed units only grow), so a gang moves at most once from the
    within-guarantee heap to the borrowing one, when it reaches the top and is found borrowing.
    """

    def __init__(self, cycle: _Cycle) -> None:
        self.cycle = cycle
        self.within: list[tuple[int, float, str, int, PendingGang]] = []
        self.borrowing: list[tuple[int, float, str, int, PendingGang]] = []

    def add(self, index: int, gang: PendingGang) -> None:
        entry = (-self.cycle.priority[gang.id], gang.submitted_at_s, gang.id, index, gang)
        heapq.heappush(self.borrowing if self.cycle._borrowing(gang) else self.within, entry)

    def __bool__(self) -> bool:
        return bool(self.within or self.borrowing)

    def _first(self) -> list:
        while self.within and self.cycle._borrowing(self.within[0][-1]):
            heapq.heappush(self.borrowing, heapq.heappop(self.within))
        return self.within or self.borrowing

    def first_key(self) -> tuple[int, float, int, float, str]:
        """The first gang's order key, as `_Cycle._order_key` makes it."""
        return self.cycle._order_key(self._first()[0][-1])

    def take_first(self) -> PendingGang:
        return heapq.heappop(self._first())[-1]


def _units_text(units_by_flavor: Mapping[str, int]) -> str:
    return ", ".join(f"{units} {flavor}" for flavor, units in units_by_flavor.items())


def _jobs_text(count: int) -> str:
    return f"{count} job{'' if count == 1 else 's'}"


class _Cycle:
    """The mutable state of one decide() call; it lives only inside it."""

    def __init__(self, snapshot: AdmissionSnapshot, now_s: float, grace_period_s: float, max_reservations: int) -> None:
        self.now_s = now_s
        self.deadline_s = now_s + grace_period_s
        self.max_reservations = max_reservations
        self.capacity = dict(snapshot.capacity_units_by_flavor)
        self.quotas: dict[str, TenantQuota] = {
            quota.tenant: quota for quota in sorted(snapshot.tenants, key=lambda q: q.tenant)
        }
        # Per tenant, each flavor's fair-share weight where some flavor has its own; None where all
        # take the tenant's (the share is then one division, the common case kept cheap).
        self.flavor_weights: dict[str, dict[str, float] | None] = {}
        for tenant, quota in self.quotas.items():
            weights = quota.flavor_weights()
            self.flavor_weights[tenant] = None if all(w == quota.weight for w in weights.values()) else weights
        self.occupied: dict[str, int] = defaultdict(int)
        self.committed: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        # Work that reclamation may still stop; work already stopping feeds the pool below instead.
        self.live: dict[str, RunningWorkload] = {}
        # flavor -> what stopping work gives back and no claimant has yet, earliest deadline first.
        self.stopping_pool: dict[str, list[_StoppingPiece]] = defaultdict(list)
        for workload in sorted(snapshot.running, key=lambda w: w.id):
            workload = self._clamped(workload)
            for flavor, units in workload.units_by_flavor.items():
                self.occupied[flavor] += units
                self.committed[workload.tenant][flavor] += units
            if workload.is_stopping:
                self._add_to_pool(workload, workload.stopping_deadline_s)
            else:
                self.live[workload.id] = workload
        self.pending = sorted(snapshot.pending, key=lambda g: g.id)
        self.priority = {
            gang.id: self._clamped_priority(gang.tenant, gang.priority, gang.units_by_flavor) for gang in self.pending
        }
        self.holds: list[_Hold] = []
        # Kept up to date as holds are made and lent from, so that no question walks every hold:
        # per flavor, units held and not lent out; how many holds hold some of it; the holds that
        # hold any free units at all (the only ones a backfill can borrow from), in order; and
        # how many borrowing gangs hold a capacity reservation.
        self.held_units: dict[str, int] = defaultdict(int)
        self.holders: dict[str, int] = defaultdict(int)
        self.lending_holds: list[_Hold] = []
        self.borrowing_reservations = 0
        self.admitted: list[Admission] = []
        # When this cycle's admissions are estimated to end, for projected starts.
        self.admitted_ends: list[_Release] = []
        self.preemptions: list[Preemption] = []
        self.waiting: list[Waiting] = []

    # --- bookkeeping ---------------------------------------------------------

    def _clamped_priority(self, tenant: str, priority: int, flavors) -> int:
        quota = self.quotas.get(tenant)
        return min(priority, quota.priority_cap(flavors)) if quota else priority

    def _clamped(self, workload: RunningWorkload) -> RunningWorkload:
        priority = self._clamped_priority(workload.tenant, workload.priority, workload.units_by_flavor)
        return workload if priority == workload.priority else dataclasses.replace(workload, priority=priority)

    def _add_to_pool(self, workload: RunningWorkload, deadline_s: float) -> None:
        for flavor, units in workload.units_by_flavor.items():
            self.stopping_pool[flavor].append(_StoppingPiece(deadline_s, units))
            self.stopping_pool[flavor].sort(key=lambda piece: piece.deadline_s)

    def _unheld(self, flavor: str) -> int:
        """Units of a flavor that are free now and held for nobody."""
        return max(0, self.capacity.get(flavor, 0) - self.occupied[flavor] - self.held_units[flavor])

    def _hold(self, hold: _Hold) -> None:
        self.holds.append(hold)
        for flavor, units in hold.held_free_units.items():
            self.held_units[flavor] += units
            self.holders[flavor] += 1
        if hold.held_free_units:
            self.lending_holds.append(hold)
        if hold.kind == CAPACITY_RESERVATION and hold.borrowing:
            self.borrowing_reservations += 1

    def _pool_units(self, flavor: str) -> int:
        return sum(piece.units for piece in self.stopping_pool.get(flavor, []))

    def _borrowing(self, gang: PendingGang) -> bool:
        quota = self.quotas[gang.tenant]
        used = self.committed[gang.tenant]
        # A loop, not any() over a generator: asked several times per gang, 100,000 gangs a cycle.
        for flavor, units in gang.units_by_flavor.items():
            if used[flavor] + units > quota.guaranteed_units(flavor):
                return True
        return False

    def _share(self, tenant: str) -> float:
        return weighted_dominant_share(
            self.committed[tenant], self.capacity, self.quotas[tenant].weight, self.flavor_weights[tenant]
        )

    def _order_key(self, gang: PendingGang) -> tuple[int, float, int, float, str]:
        return gang_order_key(
            borrowing=self._borrowing(gang),
            tenant_share=self._share(gang.tenant),
            priority=self.priority[gang.id],
            submitted_at_s=gang.submitted_at_s,
            gang_id=gang.id,
        )

    def _wait(self, gang: PendingGang, kind: WaitingKind, detail: str) -> None:
        """Record that the gang is not admitted; its reason reads 'Waiting: <detail>.' or 'Blocked: <detail>.'

        Reasons are for the gang's owner: they say "job" (a gang is one job's replicas), hold no
        clock times (the portal shows the reservation's projected start in the reader's time) and
        never name another tenant's work.
        """
        reason = f"{kind.capitalize()}: {detail}."
        self.waiting.append(Waiting(gang_id=gang.id, tenant=gang.tenant, kind=kind, reason=reason))

    # --- the cycle -----------------------------------------------------------

    def run(self) -> Decisions:
        """Refuse what can never run, then take the remaining gangs one at a time in fair-share order."""
        candidates = [gang for gang in self.pending if not self._blocked_for_good(gang)]
        # The next gang is the one with the smallest order key *now* (keys are unique: the gang id
        # is their last part). Deciding a gang only ever adds to its own tenant's committed units,
        # so only that tenant's keys move. So each tenant keeps its own line, and one heap holds
        # each tenant's first gang under its key: the smallest of those is the smallest of all.
        lines: dict[str, _TenantLine] = {}
        for index, gang in enumerate(candidates):
            line = lines.get(gang.tenant)
            if line is None:
                line = lines[gang.tenant] = _TenantLine(self)
            line.add(index, gang)
        heap = []
        for tenant, line in lines.items():
            heap.append((line.first_key(), tenant))
        heapq.heapify(heap)
        while heap:
            _, tenant = heapq.heappop(heap)
            line = lines[tenant]
            self._decide_one(line.take_first())
            if line:
                heapq.heappush(heap, (line.first_key(), tenant))
        return Decisions(
            admitted=tuple(self.admitted),
            preemptions=tuple(self.preemptions),
            reservations=tuple(
                Reservation(
                    gang_id=hold.gang_id,
                    tenant=hold.tenant,
                    kind=hold.kind,
                    held_units_by_flavor=MappingProxyType(_merged(hold.held_free_units, hold.pledged_stopping_units)),
                    projected_start_s=hold.projected_start_s,
                )
                for hold in self.holds
            ),
            waiting=tuple(self.waiting),
        )

    def _blocked_for_good(self, gang: PendingGang) -> bool:
        """Wait with a 'blocked' reason if no amount of waiting would admit this gang."""
        quota = self.quotas.get(gang.tenant)
        if quota is None:
            self._wait(gang, "blocked", f"tenant {gang.tenant} has no quota; ask an admin to set one")
            return True
        if not gang.units_by_flavor:
            self._wait(gang, "blocked", "the job asks for no units; ask for at least one unit of a flavor")
            return True
        for flavor, units in gang.units_by_flavor.items():
            if quota.max_units(flavor) == 0:
                self._wait(gang, "blocked", f"tenant {gang.tenant} has no quota for {flavor}; ask an admin for one")
                return True
            if units > quota.max_units(flavor):
                self._wait(
                    gang,
                    "blocked",
                    f"it needs {units} {flavor} but tenant {gang.tenant}'s max is {quota.max_units(flavor)}; "
                    "make the job smaller or ask an admin for a larger quota",
                )
                return True
            if units > self.capacity.get(flavor, 0):
                self._wait(
                    gang,
                    "blocked",
                    f"it needs {units} {flavor} but the whole cluster has {self.capacity.get(flavor, 0)} now; "
                    "make the job smaller, or wait until capacity comes back",
                )
                return True
        return False

    def _decide_one(self, gang: PendingGang) -> None:
        quota = self.quotas[gang.tenant]
        used = self.committed[gang.tenant]
        for flavor, units in gang.units_by_flavor.items():
            if used[flavor] + units > quota.max_units(flavor):
                self._wait(
                    gang,
                    "waiting",
                    f"tenant {gang.tenant} is at its max for {flavor} (max {quota.max_units(flavor)}, "
                    f"{used[flavor]} in use, it needs {units} more); it starts when the tenant's other jobs free some",
                )
                return
        borrowing = self._borrowing(gang)
        if borrowing and not gang.preemptible:
            flavor, units = next(
                (f, u) for f, u in gang.units_by_flavor.items() if used[f] + u > quota.guaranteed_units(f)
            )
            self._wait(
                gang,
                "waiting",
                f"a non-preemptible job must fit in tenant {gang.tenant}'s guarantee for {flavor} "
                f"(guaranteed {quota.guaranteed_units(flavor)}, {used[flavor]} in use, it needs {units}); "
                "mark it preemptible to borrow idle capacity",
            )
            return
        if all(units <= self._unheld(flavor) for flavor, units in gang.units_by_flavor.items()):
            self._admit(gang, borrowing, backfilled=False)
            return
        if self._backfill(gang, borrowing):
            return
        choice: Optional[VictimChoice] = None
        if not borrowing:
            choice = self._claim_guarantee(gang)
            if choice is None:
                return
        self._reserve_or_wait(gang, borrowing, choice)

    def _admit(self, gang: PendingGang, borrowing: bool, *, backfilled: bool) -> None:
        quota = self.quotas[gang.tenant]
        used = self.committed[gang.tenant]
        borrowed: dict[str, int] = {}
        for flavor, units in gang.units_by_flavor.items():
            self.occupied[flavor] += units
            used[flavor] += units
            beyond = min(units, max(0, used[flavor] - quota.guaranteed_units(flavor)))
            if beyond:
                borrowed[flavor] = beyond
        if gang.estimated_runtime_s is not None:
            self.admitted_ends.append(_Release(self.now_s + gang.estimated_runtime_s, gang.units_by_flavor))
        self.admitted.append(
            Admission(
                gang_id=gang.id,
                tenant=gang.tenant,
                within_guarantee=not borrowing,
                borrowed_units_by_flavor=MappingProxyType(borrowed),
                priority=self.priority[gang.id],
                backfilled=backfilled,
            )
        )

    def _backfill(self, gang: PendingGang, borrowing: bool) -> bool:
        """Admit into held capacity when the gang's estimated end comes before every such holder starts."""
        if gang.estimated_runtime_s is None:
            return False
        end_s = self.now_s + gang.estimated_runtime_s
        # A hold with an unknown start could start any moment, so nothing may borrow from it. Holds
        # of no free units have nothing to lend and are left out.
        lenders = [
            hold for hold in self.lending_holds if hold.projected_start_s is not None and end_s <= hold.projected_start_s
        ]
        if not lenders:
            return False
        lendable = {
            flavor: sum(
                hold.held_free_units.get(flavor, 0) - hold.backfill_used_units.get(flavor, 0) for hold in lenders
            )
            for flavor in gang.units_by_flavor
        }
        if any(units > self._unheld(flavor) + lendable[flavor] for flavor, units in gang.units_by_flavor.items()):
            return False
        for flavor, units in gang.units_by_flavor.items():
            from_holds = units - self._unheld(flavor)
            for hold in lenders:
                if from_holds <= 0:
                    break
                spare = hold.held_free_units.get(flavor, 0) - hold.backfill_used_units.get(flavor, 0)
                take = min(spare, from_holds)
                if take > 0:
                    hold.backfill_used_units[flavor] = hold.backfill_used_units.get(flavor, 0) + take
                    self.held_units[flavor] -= take
                    from_holds -= take
        self._admit(gang, borrowing, backfilled=True)
        return True

    def _claim_guarantee(self, gang: PendingGang) -> Optional[VictimChoice]:
        """Hold free units, claim stopping ones, and preempt borrowed work for the rest; None once claimed."""
        held_free = {flavor: min(units, self._unheld(flavor)) for flavor, units in gang.units_by_flavor.items()}
        needed = {
            flavor: units - held_free[flavor]
            for flavor, units in gang.units_by_flavor.items()
            if units > held_free[flavor]
        }
        shortfall = {
            flavor: units - self._pool_units(flavor)
            for flavor, units in needed.items()
            if units > self._pool_units(flavor)
        }
        victims: tuple[RunningWorkload, ...] = ()
        if shortfall:
            choice = choose_victims(
                shortfall_units_by_flavor=shortfall,
                claimant_tenant=gang.tenant,
                live_workloads=self.live.values(),
                quotas_by_tenant=self.quotas,
                now_s=self.now_s,
            )
            if not choice.covers:
                return choice
            victims = choice.victims
        for victim in victims:
            del self.live[victim.id]
            self._add_to_pool(victim, self.deadline_s)
            borrowed_flavors = ", ".join(flavor for flavor in victim.units_by_flavor if flavor in shortfall)
            self.preemptions.append(
                Preemption(
                    workload_id=victim.id,
                    tenant=victim.tenant,
                    for_gang_id=gang.id,
                    # The portal names the claimant's job; the deadline is deadline_s, not text.
                    reason=(
                        f"tenant {victim.tenant} is borrowing {borrowed_flavors} beyond its guarantee and "
                        f"tenant {gang.tenant} needs its guarantee back"
                    ),
                    deadline_s=self.deadline_s,
                )
            )
        pledged: dict[str, int] = {}
        start_s = self.now_s
        for flavor, units in needed.items():
            pieces = self.stopping_pool[flavor]
            while units > 0:
                # Enough is in the pool: the shortfall was covered by victims or by earlier stops.
                piece = pieces[0]
                take = min(piece.units, units)
                piece.units -= take
                units -= take
                pledged[flavor] = pledged.get(flavor, 0) + take
                start_s = max(start_s, piece.deadline_s)
                if piece.units == 0:
                    pieces.pop(0)
        self._hold(
            _Hold(
                gang_id=gang.id,
                tenant=gang.tenant,
                kind=GUARANTEE_CLAIM,
                held_free_units={flavor: units for flavor, units in held_free.items() if units},
                pledged_stopping_units=pledged,
                projected_start_s=start_s,
            )
        )
        for flavor, units in gang.units_by_flavor.items():
            self.committed[gang.tenant][flavor] += units
        self._wait(
            gang,
            "waiting",
            f"other tenants' borrowed work is checkpointing and stopping to give tenant {gang.tenant} back its "
            f"guarantee ({_units_text(pledged)}); it starts as soon as that work has stopped",
        )
        return None

    def _reserve_or_wait(self, gang: PendingGang, borrowing: bool, choice: Optional[VictimChoice]) -> None:
        """Hold free units for the gang if a reservation is left, and say what it waits for."""
        short = {
            flavor: (self._unheld(flavor), units)
            for flavor, units in gang.units_by_flavor.items()
            if units > self._unheld(flavor)
        }
        flavor, (free_units, units) = next(iter(short.items()))
        if borrowing:
            quota = self.quotas[gang.tenant]
            used = self.committed[gang.tenant]
            borrowed_flavor = next(
                f for f, u in gang.units_by_flavor.items() if used[f] + u > quota.guaranteed_units(f)
            )
            detail = (
                f"only {free_units} {flavor} idle, it needs {units}; that would take tenant {gang.tenant} past its "
                f"guarantee for {borrowed_flavor} (guaranteed {quota.guaranteed_units(borrowed_flavor)}, "
                f"{used[borrowed_flavor]} in use), and past its guarantee a job only uses idle GPUs"
            )
        else:
            detail = f"only {free_units} {flavor} free, it needs {units}"
        # Counted, never named: the jobs capacity is held for may be other tenants'.
        # Each hold is one gang's.
        held_by_others = self.holders[flavor]
        if held_by_others:
            detail += f"; some of it is held for {_jobs_text(held_by_others)} ahead in line"
        if choice is not None and choice.protected_units_by_flavor:
            detail += (
                "; other tenants' borrowed work cannot be preempted yet "
                f"({_units_text(choice.protected_units_by_flavor)} non-preemptible or inside its minimum runtime)"
            )
        # Work within its guarantee always holds what is free of what it is owed; only borrowing
        # gangs compete for the max_reservations slots, so guarantees never wait behind a slot.
        if not borrowing or self.borrowing_reservations < self.max_reservations:
            held_free = {flavor: min(units, self._unheld(flavor)) for flavor, units in gang.units_by_flavor.items()}
            still_needed = {
                flavor: units - held_free[flavor]
                for flavor, units in gang.units_by_flavor.items()
                if units > held_free[flavor]
            }
            start_s = self._projected_start(still_needed)
            self._hold(
                _Hold(
                    gang_id=gang.id,
                    tenant=gang.tenant,
                    kind=CAPACITY_RESERVATION,
                    held_free_units={flavor: units for flavor, units in held_free.items() if units},
                    pledged_stopping_units={},
                    projected_start_s=start_s,
                    borrowing=borrowing,
                )
            )
            for flavor, units in held_free.items():
                self.committed[gang.tenant][flavor] += units
            detail += "; what frees up is reserved for it" + (
                "" if start_s is not None else ", though when running work ends is unknown"
            )
        self._wait(gang, "waiting", detail)

    def _projected_start(self, still_needed: Mapping[str, int]) -> Optional[float]:
        """When the still-needed units come back, going by estimated ends and preemption deadlines."""
        releases: list[_Release] = []
        for workload in self.live.values():
            if workload.estimated_runtime_s is not None:
                releases.append(
                    _Release(max(self.now_s, workload.started_at_s + workload.estimated_runtime_s), workload.units_by_flavor)
                )
        releases.extend(self.admitted_ends)
        for flavor, pieces in sorted(self.stopping_pool.items()):
            releases.extend(
                _Release(max(self.now_s, piece.deadline_s), {flavor: piece.units}) for piece in pieces if piece.units
            )
        remaining = dict(still_needed)
        for release in sorted(releases, key=lambda release: release.time_s):
            for flavor, units in release.units_by_flavor.items():
                if flavor in remaining:
                    remaining[flavor] -= units
            if all(units <= 0 for units in remaining.values()):
                return release.time_s
        return None


def _merged(first: Mapping[str, int], second: Mapping[str, int]) -> dict[str, int]:
    merged: dict[str, int] = defaultdict(int)
    for units_by_flavor in (first, second):
        for flavor, units in units_by_flavor.items():
            merged[flavor] += units
    return dict(sorted(merged.items()))
