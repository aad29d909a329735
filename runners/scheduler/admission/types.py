"""Plain data for fair share, admission and preemption: what a scheduler cycle snapshots and gets back.

These types belong to the admission layer only, so that it can be tested and
replayed without the placement model. Quantities are whole units of a flavor
("H100-80GB", "H100-80GB/mig-1g.10gb"); times are seconds on one clock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal, Mapping, Optional

# What a reservation waits for: preempted work to stop ("guarantee"), or running work to end ("capacity").
ReservationKind = Literal["guarantee", "capacity"]
GUARANTEE_CLAIM: Final[ReservationKind] = "guarantee"
CAPACITY_RESERVATION: Final[ReservationKind] = "capacity"

# Why a gang was not admitted: "blocked" when no amount of waiting would admit it as it is (no
# quota, bigger than its max or the cluster, no units asked), "waiting" when a later cycle may.
WaitingKind = Literal["blocked", "waiting"]


def frozen_units(owner: str, field_name: str, units_by_flavor: Mapping[str, int]) -> Mapping[str, int]:
    """Copy a flavor -> units mapping into a read-only one, sorted, without zero entries."""
    for flavor, units in units_by_flavor.items():
        if not isinstance(flavor, str) or not flavor:
            raise ValueError(f"{owner}: {field_name} keys must be flavor names, got {flavor!r}")
        # bool is an int in Python; a True here is always a caller's mistake.
        if isinstance(units, bool) or not isinstance(units, int) or units < 0:
            raise ValueError(f"{owner}: {field_name}[{flavor!r}] must be a whole number of units >= 0, got {units!r}")
    return MappingProxyType({flavor: units for flavor, units in sorted(units_by_flavor.items()) if units > 0})


@dataclass(frozen=True)
class FlavorQuota:
    """A tenant's guaranteed and maximum units of one flavor, and optionally that flavor's own
    fair-share weight and highest priority (None: the tenant's)."""

    guaranteed_units: int
    max_units: int
    weight: float | None = None
    max_priority: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.guaranteed_units <= self.max_units:
            raise ValueError(
                f"FlavorQuota needs 0 <= guaranteed_units <= max_units, got {self.guaranteed_units} and "
                f"{self.max_units}: raise max_units or lower guaranteed_units"
            )


@dataclass(frozen=True)
class TenantQuota:
    """What one tenant may use: per-flavor quotas, its fair-share weight and its highest priority."""

    tenant: str
    quotas: Mapping[str, FlavorQuota]
    weight: float = 1.0
    max_priority: int = 0

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"TenantQuota {self.tenant!r}: weight must be > 0, got {self.weight!r}")
        object.__setattr__(self, "quotas", MappingProxyType(dict(sorted(self.quotas.items()))))

    def guaranteed_units(self, flavor: str) -> int:
        """Guaranteed units of a flavor; a flavor without a quota guarantees nothing."""
        quota = self.quotas.get(flavor)
        return quota.guaranteed_units if quota else 0

    def flavor_weights(self) -> dict[str, float]:
        """The fair-share weight of each flavor: its quota's own, else the tenant's."""
        return {flavor: quota.weight or self.weight for flavor, quota in self.quotas.items()}

    def priority_cap(self, flavors) -> int:
        """The highest priority a workload on these flavors may have: the lowest of their caps."""
        caps = [quota.max_priority for flavor in flavors if (quota := self.quotas.get(flavor)) is not None
                and quota.max_priority is not None]
        return min(caps) if caps else self.max_priority

    def max_units(self, flavor: str) -> int:
        """Maximum units of a flavor; a flavor without a quota may not be used at all."""
        quota = self.quotas.get(flavor)
        return quota.max_units if quota else 0


@dataclass(frozen=True)
class RunningWorkload:
    """Work that holds units now; stopping_deadline_s is set once it has been told to checkpoint and stop."""

    id: str
    tenant: str
    units_by_flavor: Mapping[str, int]
    priority: int = 0
    preemptible: bool = True
    started_at_s: float = 0.0
    min_runtime_s: float = 0.0
    estimated_runtime_s: Optional[float] = None
    stopping_deadline_s: Optional[float] = None

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "units_by_flavor",
            frozen_units(f"RunningWorkload {self.id!r}", "units_by_flavor", self.units_by_flavor),
        )

    @property
    def is_stopping(self) -> bool:
        """True once a preemption is under way: its units come back at stopping_deadline_s."""
        return self.stopping_deadline_s is not None


@dataclass(frozen=True)
class PendingGang:
    """A gang waiting for admission: all of its units are admitted together or not at all."""

    id: str
    tenant: str
    units_by_flavor: Mapping[str, int]
    priority: int = 0
    submitted_at_s: float = 0.0
    estimated_runtime_s: Optional[float] = None
    # Non-preemptible work could never be reclaimed, so it is only admitted within guarantee.
    preemptible: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "units_by_flavor", frozen_units(f"PendingGang {self.id!r}", "units_by_flavor", self.units_by_flavor)
        )


@dataclass(frozen=True)
class AdmissionSnapshot:
    """Everything one admission decision looks at, taken in one transaction."""

    capacity_units_by_flavor: Mapping[str, int]
    tenants: tuple[TenantQuota, ...]
    running: tuple[RunningWorkload, ...] = ()
    pending: tuple[PendingGang, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "capacity_units_by_flavor",
            frozen_units("AdmissionSnapshot", "capacity_units_by_flavor", self.capacity_units_by_flavor),
        )
        object.__setattr__(self, "tenants", tuple(self.tenants))
        object.__setattr__(self, "running", tuple(self.running))
        object.__setattr__(self, "pending", tuple(self.pending))
        for kind, ids in (
            ("tenant", [quota.tenant for quota in self.tenants]),
            ("running workload", [workload.id for workload in self.running]),
            ("pending gang", [gang.id for gang in self.pending]),
        ):
            # Counted once, not with list.count per id: a cycle may hold 100,000 pending gangs.
            duplicates = sorted(item for item, times in Counter(ids).items() if times > 1)
            if duplicates:
                raise ValueError(f"AdmissionSnapshot: each {kind} must appear once, these repeat: {duplicates}")


@dataclass(frozen=True)
class Admission:
    """A gang admitted now; borrowed_units_by_flavor is what it uses beyond its tenant's guarantee."""

    gang_id: str
    tenant: str
    within_guarantee: bool
    borrowed_units_by_flavor: Mapping[str, int]
    priority: int
    # True when it runs in capacity held for a reserved gang, on the promise that it ends first.
    backfilled: bool = False


@dataclass(frozen=True)
class Preemption:
    """A running workload told to checkpoint now and be stopped at deadline_s.

    reason says why in words (which tenant borrows what, whose guarantee is owed), with no gang id
    and no time: the caller names the claimant's job its own way and shows deadline_s as a time.
    """

    workload_id: str
    tenant: str
    for_gang_id: str
    reason: str
    deadline_s: float


@dataclass(frozen=True)
class Reservation:
    """Units held for a gang that cannot start yet, so that later gangs cannot delay it.

    kind is "guarantee" when the gang waits for preempted work to stop (its start
    is then known) and "capacity" when it waits for running work to end.
    projected_start_s is None when the end of the work it waits for is unknown.
    """

    gang_id: str
    tenant: str
    kind: ReservationKind
    held_units_by_flavor: Mapping[str, int]
    projected_start_s: Optional[float]


@dataclass(frozen=True)
class Waiting:
    """A pending gang that was not admitted, with a reason its owner can read.

    The reason starts with its kind, capitalized ("Waiting: ...", "Blocked: ..."), and holds no
    clock time: a reserved gang's projected start is its Reservation's projected_start_s.
    """

    gang_id: str
    tenant: str
    kind: WaitingKind
    reason: str


@dataclass(frozen=True)
class Decisions:
    """What one cycle decided, in the order it decided it."""

    admitted: tuple[Admission, ...]
    preemptions: tuple[Preemption, ...]
    reservations: tuple[Reservation, ...]
    waiting: tuple[Waiting, ...]

    def reason_for(self, gang_id: str) -> Optional[str]:
        """The reason a gang waits, or None if it was admitted or unknown."""
        return next((waiting.reason for waiting in self.waiting if waiting.gang_id == gang_id), None)

    @property
    def admitted_ids(self) -> tuple[str, ...]:
        """Admitted gang ids, in admission order."""
        return tuple(admission.gang_id for admission in self.admitted)

    @property
    def preempted_ids(self) -> tuple[str, ...]:
        """Preempted workload ids, in the order they were chosen."""
        return tuple(preemption.workload_id for preemption in self.preemptions)
