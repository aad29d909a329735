"""Admission: which pending gangs start now, what is preempted for them, and what is held for later.

`decide(snapshot, now_s)` is the whole interface: a pure function of an `AdmissionSnapshot` that
returns `Decisions`. The modules:

- `cycle`: `decide` and the rules it applies, one pending gang at a time in fair-share order.
- `preemption`: which running work is borrowed, and which of it to stop for a guarantee.
- `types`: the snapshot going in and the decisions coming out, as frozen dataclasses.

No placement here: admission counts whole units of a flavor; `placement.place_gangs` then decides
where the admitted gangs' pods go.
"""

from .cycle import DEFAULT_GRACE_PERIOD_S, decide
from .types import (
    Admission,
    AdmissionSnapshot,
    Decisions,
    FlavorQuota,
    PendingGang,
    Preemption,
    Reservation,
    ReservationKind,
    RunningWorkload,
    TenantQuota,
    Waiting,
    WaitingKind,
)

__all__ = [
    "DEFAULT_GRACE_PERIOD_S",
    "Admission",
    "AdmissionSnapshot",
    "Decisions",
    "FlavorQuota",
    "PendingGang",
    "Preemption",
    "Reservation",
    "ReservationKind",
    "RunningWorkload",
    "TenantQuota",
    "Waiting",
    "WaitingKind",
    "decide",
]
