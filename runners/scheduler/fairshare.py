"""Weighted dominant-resource fair share: who goes next when tenants compete for the same cluster.

A tenant's dominant share is its largest fraction of any one flavor's capacity
(Ghodsi et al., "Dominant Resource Fairness", NSDI 2011); dividing by the
tenant's weight lets an admin give a team a larger fair share. Pure functions
over flavor -> units mappings, so the admission layer and trace replay agree.
"""

from __future__ import annotations

from typing import Mapping


def dominant_share(usage_units_by_flavor: Mapping[str, int], capacity_units_by_flavor: Mapping[str, int]) -> float:
    """The largest fraction of any flavor's capacity that this usage takes, 0.0 for no usage."""
    share = 0.0
    for flavor, units in usage_units_by_flavor.items():
        capacity_units = capacity_units_by_flavor.get(flavor, 0)
        # A flavor the cluster no longer has cannot be shared fairly; skipping it keeps
        # the share finite, and admission refuses new work on it anyway.
        if units > 0 and capacity_units > 0:
            share = max(share, units / capacity_units)
    return share


def weighted_dominant_share(
    usage_units_by_flavor: Mapping[str, int], capacity_units_by_flavor: Mapping[str, int], weight: float,
    flavor_weights: Mapping[str, float] | None = None,
) -> float:
    """Dominant share with each flavor's share divided by its weight (the flavor's own, else `weight`; > 0)."""
    if not weight > 0:
        raise ValueError(f"weight must be > 0, got {weight!r}: set a positive fair-share weight on the tenant")
    if not flavor_weights:
        return dominant_share(usage_units_by_flavor, capacity_units_by_flavor) / weight
    share = 0.0
    for flavor, units in usage_units_by_flavor.items():
        flavor_weight = flavor_weights.get(flavor) or weight
        share = max(share, dominant_share({flavor: units}, capacity_units_by_flavor) / flavor_weight)
    return share


def gang_order_key(
    *, borrowing: bool, tenant_share: float, priority: int, submitted_at_s: float, gang_id: str
) -> tuple[int, float, int, float, str]:
    """Sort key for the next pending gang: within-guarantee first, then lowest share, highest priority, oldest, id.

    Gangs that fit in their tenant's guarantee go before borrowing ones (as in
    Kueue), so borrowed capacity is never handed out while a guarantee waits.
    The id makes the order total, so the same snapshot always gives the same order.
    """
    return (1 if borrowing else 0, tenant_share, -priority, submitted_at_s, gang_id)
