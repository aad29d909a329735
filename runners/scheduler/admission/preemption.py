"""Which running work is borrowed, and which of it to preempt to give a tenant back its guarantee.

Borrowing rule: per tenant and flavor, walk the tenant's running workloads
oldest first (started_at_s, then id); units past the guarantee are borrowed.
So the newest work is the borrowed work, and finishing or preempting newer
work never turns older work into borrowed work.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from .types import RunningWorkload, TenantQuota


def borrowed_units(
    workloads: Iterable[RunningWorkload], quotas_by_tenant: Mapping[str, TenantQuota]
) -> dict[str, dict[str, int]]:
    """Workload id -> flavor -> units it uses beyond its tenant's guarantee (only non-zero entries)."""
    used_by_tenant_flavor: dict[tuple[str, str], int] = defaultdict(int)
    borrowed: dict[str, dict[str, int]] = {}
    for workload in sorted(workloads, key=lambda w: (w.started_at_s, w.id)):
        quota = quotas_by_tenant.get(workload.tenant)
        for flavor, units in workload.units_by_flavor.items():
            guaranteed = quota.guaranteed_units(flavor) if quota else 0
            before = used_by_tenant_flavor[workload.tenant, flavor]
            after = before + units
            used_by_tenant_flavor[workload.tenant, flavor] = after
            beyond = min(units, max(0, after - guaranteed))
            if beyond:
                borrowed.setdefault(workload.id, {})[flavor] = beyond
    return borrowed


def is_protected(workload: RunningWorkload, now_s: float) -> bool:
    """True for work that reclamation never stops: non-preemptible, or still inside its minimum runtime."""
    return not workload.preemptible or now_s - workload.started_at_s < workload.min_runtime_s


@dataclass(frozen=True)
class VictimChoice:
    """The victims chosen for one shortfall, or why there are none."""

    victims: tuple[RunningWorkload, ...]
    # Borrowed units in the short flavors that reclamation may not touch, and when the
    # earliest minimum runtime among them ends (None if none will ever become eligible).
    protected_units_by_flavor: Mapping[str, int]
    protected_until_s: Optional[float]

    @property
    def covers(self) -> bool:
        """True when the victims free the whole shortfall."""
        return bool(self.victims)


def _victim_order_key(
    workload: RunningWorkload, borrowed: Mapping[str, int], short_flavors: set[str]
) -> tuple[int, int, float, str]:
    """Borrowed work first (wholly borrowed before partly), then lower priority, newest first, then id.

    Non-preemptible work never reaches this key: reclamation skips it, which is
    how "preemptible before not" is applied.
    """
    wholly_borrowed = all(
        borrowed.get(flavor, 0) == units
        for flavor, units in workload.units_by_flavor.items()
        if flavor in short_flavors
    )
    return (0 if wholly_borrowed else 1, workload.priority, -workload.started_at_s, workload.id)


def _still_short(shortfall: Mapping[str, int], victims: Iterable[RunningWorkload]) -> bool:
    """True if these victims together free less than the shortfall in some flavor."""
    freed: dict[str, int] = defaultdict(int)
    for victim in victims:
        for flavor, units in victim.units_by_flavor.items():
            freed[flavor] += units
    return any(freed[flavor] < units for flavor, units in shortfall.items())


def choose_victims(
    *,
    shortfall_units_by_flavor: Mapping[str, int],
    claimant_tenant: str,
    live_workloads: Iterable[RunningWorkload],
    quotas_by_tenant: Mapping[str, TenantQuota],
    now_s: float,
) -> VictimChoice:
    """Pick a minimal set of other tenants' borrowed, preemptible work that frees the shortfall, or none.

    Greedy in victim order, recomputing who still borrows after each pick, so a
    tenant is never pushed below its guarantee by more than one gang's size;
    then every victim that is not needed is put back (latest pick kept), so no
    victim in the answer could be spared. If all eligible work cannot cover the
    shortfall, nothing is preempted: stopping some of it would waste their
    progress without letting the claimant start.
    """
    shortfall = {flavor: units for flavor, units in shortfall_units_by_flavor.items() if units > 0}
    live = [workload for workload in live_workloads if not workload.is_stopping]
    short_flavors = set(shortfall)
    remaining = dict(shortfall)
    chosen: list[RunningWorkload] = []
    chosen_ids: set[str] = set()
    while any(units > 0 for units in remaining.values()):
        still_live = [workload for workload in live if workload.id not in chosen_ids]
        borrowed = borrowed_units(still_live, quotas_by_tenant)
        open_flavors = {flavor for flavor, units in remaining.items() if units > 0}
        candidates = [
            workload
            for workload in still_live
            if workload.tenant != claimant_tenant
            and not is_protected(workload, now_s)
            and any(flavor in open_flavors for flavor in borrowed.get(workload.id, {}))
        ]
        if not candidates:
            return _no_victims(live, quotas_by_tenant, claimant_tenant, short_flavors, now_s)
        victim = min(candidates, key=lambda w: _victim_order_key(w, borrowed.get(w.id, {}), open_flavors))
        chosen.append(victim)
        chosen_ids.add(victim.id)
        for flavor, units in victim.units_by_flavor.items():
            if flavor in remaining:
                remaining[flavor] -= units
    # Put back what is not needed, from the second-latest pick back to the first (the
    # latest is what made it fit). Dropping a victim only makes the others borrow more,
    # so the rest stay valid victims, and a victim needed once stays needed.
    for index in range(len(chosen) - 2, -1, -1):
        trial = chosen[:index] + chosen[index + 1 :]
        if not _still_short(shortfall, trial):
            chosen = trial
    return VictimChoice(victims=tuple(chosen), protected_units_by_flavor={}, protected_until_s=None)


def _no_victims(
    live: list[RunningWorkload],
    quotas_by_tenant: Mapping[str, TenantQuota],
    claimant_tenant: str,
    short_flavors: set[str],
    now_s: float,
) -> VictimChoice:
    """Say how much borrowed work in the short flavors is protected, and until when."""
    borrowed = borrowed_units(live, quotas_by_tenant)
    protected_units: dict[str, int] = defaultdict(int)
    eligible_at_s: list[float] = []
    for workload in live:
        if workload.tenant == claimant_tenant or not is_protected(workload, now_s):
            continue
        in_short = {flavor: units for flavor, units in borrowed.get(workload.id, {}).items() if flavor in short_flavors}
        if not in_short:
            continue
        for flavor, units in in_short.items():
            protected_units[flavor] += units
        if workload.preemptible:
            eligible_at_s.append(workload.started_at_s + workload.min_runtime_s)
    return VictimChoice(
        victims=(),
        protected_units_by_flavor=dict(sorted(protected_units.items())),
        protected_until_s=min(eligible_at_s) if eligible_at_s else None,
    )
