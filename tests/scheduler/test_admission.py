"""Admission rules, one at a time: order, guarantee, borrowing, max, preemption, reservations, backfill."""

import pytest

from runners.scheduler.admission import decide
from runners.scheduler.admission.preemption import borrowed_units, choose_victims
from runners.scheduler.admission.types import (
    AdmissionSnapshot,
    FlavorQuota,
    PendingGang,
    RunningWorkload,
    TenantQuota,
)

pytestmark = pytest.mark.unit

H100 = "H100-80GB"
MIG = "H100-80GB/mig-1g.10gb"
NOW_S = 1000.0


def tenant(name, guaranteed_units, max_units, flavor=H100, **extra):
    return TenantQuota(name, {flavor: FlavorQuota(guaranteed_units, max_units)}, **extra)


def running(workload_id, tenant_name, units, **extra):
    extra.setdefault("started_at_s", 0.0)
    return RunningWorkload(workload_id, tenant_name, {H100: units}, **extra)


def gang(gang_id, tenant_name, units, **extra):
    return PendingGang(gang_id, tenant_name, {H100: units}, **extra)


def snapshot(capacity_units, tenants, running_workloads=(), pending_gangs=()):
    return AdmissionSnapshot({H100: capacity_units}, tuple(tenants), tuple(running_workloads), tuple(pending_gangs))


# --- order -------------------------------------------------------------------


def test_the_tenant_with_the_lower_weighted_share_goes_first():
    cluster = snapshot(
        8,
        [tenant("ml-a", 0, 8), tenant("ml-b", 0, 8)],
        [running("a-old", "ml-a", 3), running("b-old", "ml-b", 1)],
        [gang("a1", "ml-a", 2), gang("b1", "ml-b", 2), gang("b2", "ml-b", 2)],
    )
    # b (1/8) goes first, then b again (3/8 == a's 3/8, tie to priority, time, id: a1 < b2).
    assert decide(cluster, NOW_S).admitted_ids == ("b1", "a1")


def test_a_heavier_weight_earns_a_larger_fair_share():
    cluster = snapshot(
        8,
        [tenant("ml-a", 0, 8, weight=1.0), tenant("ml-b", 0, 8, weight=3.0)],
        [running("a-old", "ml-a", 2), running("b-old", "ml-b", 4)],
        [gang("a1", "ml-a", 2), gang("b1", "ml-b", 2)],
    )
    # b's 4/8 over weight 3 (0.17) is below a's 2/8 (0.25), so b takes the last idle pair.
    decisions = decide(cluster, NOW_S, max_reservations=0)
    assert decisions.admitted_ids == ("b1",)
    assert decisions.reason_for("a1") == (
        "Waiting: only 0 H100-80GB idle, it needs 2; that would take tenant ml-a past its guarantee for "
        "H100-80GB (guaranteed 0, 2 in use), and past its guarantee a job only uses idle GPUs."
    )


def test_the_share_is_recomputed_after_each_admission_so_tenants_alternate():
    cluster = snapshot(
        8,
        [tenant("ml-a", 0, 8), tenant("ml-b", 0, 8)],
        [],
        [gang(f"a{i}", "ml-a", 1, submitted_at_s=i) for i in range(3)]
        + [gang(f"b{i}", "ml-b", 1, submitted_at_s=i) for i in range(3)],
    )
    assert decide(cluster, NOW_S).admitted_ids == ("a0", "b0", "a1", "b1", "a2", "b2")


def test_within_one_tenant_higher_priority_then_older_goes_first():
    cluster = snapshot(
        2,
        [tenant("ml-a", 2, 2, max_priority=5)],
        [],
        [
            gang("old", "ml-a", 1, submitted_at_s=1),
            gang("new", "ml-a", 1, submitted_at_s=2),
            gang("urgent", "ml-a", 1, priority=5, submitted_at_s=3),
        ],
    )
    assert decide(cluster, NOW_S).admitted_ids == ("urgent", "old")


def test_a_priority_above_the_tenants_max_priority_is_clamped():
    cluster = snapshot(
        1,
        [tenant("ml-a", 1, 1, max_priority=2)],
        [],
        [
            gang("sneaky", "ml-a", 1, priority=99, submitted_at_s=2),
            gang("honest", "ml-a", 1, priority=2, submitted_at_s=1),
        ],
    )
    decisions = decide(cluster, NOW_S)
    # Clamped to 2, the older gang of the same priority wins.
    assert decisions.admitted_ids == ("honest",)
    assert decisions.admitted[0].priority == 2


def test_the_order_of_the_snapshot_does_not_change_the_decision():
    tenants = [tenant("ml-a", 2, 6), tenant("ml-b", 2, 6)]
    gangs = [gang("a1", "ml-a", 3), gang("b1", "ml-b", 3), gang("b2", "ml-b", 1)]
    forward = decide(snapshot(8, tenants, [], gangs), NOW_S)
    backward = decide(snapshot(8, tenants[::-1], [], gangs[::-1]), NOW_S)
    assert forward == backward


# --- guarantee, borrowing, max -------------------------------------------------


def test_it_admits_within_guarantee_when_capacity_is_free():
    decisions = decide(snapshot(8, [tenant("ml-a", 4, 8)], [], [gang("a1", "ml-a", 4)]), NOW_S)
    assert decisions.admitted_ids == ("a1",)
    assert decisions.admitted[0].within_guarantee
    assert dict(decisions.admitted[0].borrowed_units_by_flavor) == {}


def test_it_lets_idle_capacity_be_borrowed_up_to_max():
    decisions = decide(snapshot(8, [tenant("ml-a", 2, 6)], [], [gang("a1", "ml-a", 5)]), NOW_S)
    assert decisions.admitted_ids == ("a1",)
    assert not decisions.admitted[0].within_guarantee
    assert dict(decisions.admitted[0].borrowed_units_by_flavor) == {H100: 3}


def test_it_never_admits_past_max_and_says_so():
    cluster = snapshot(16, [tenant("ml-a", 4, 8)], [running("a-old", "ml-a", 8)], [gang("a1", "ml-a", 2)])
    decisions = decide(cluster, NOW_S)
    assert decisions.admitted_ids == ()
    assert decisions.reason_for("a1") == (
        "Waiting: tenant ml-a is at its max for H100-80GB (max 8, 8 in use, it needs 2 more); it starts when the "
        "tenant's other jobs free some."
    )


def test_borrowing_never_takes_capacity_a_guarantee_is_waiting_for():
    # a is owed 4 but only 2 are free and b's borrowed work is inside its minimum runtime.
    cluster = snapshot(
        8,
        [tenant("ml-a", 4, 8), tenant("ml-b", 2, 8), tenant("ml-c", 2, 8)],
        [running("b-big", "ml-b", 6, started_at_s=NOW_S - 10, min_runtime_s=600)],
        [gang("a1", "ml-a", 4), gang("c1", "ml-c", 3)],
    )
    decisions = decide(cluster, NOW_S)
    assert decisions.preemptions == ()
    assert "a1" not in decisions.admitted_ids
    # c's gang would borrow one unit; the two free ones are held for a.
    assert decisions.admitted_ids == ()
    assert [r.gang_id for r in decisions.reservations] == ["a1", "c1"]
    assert "cannot be preempted yet" in decisions.reason_for("a1")
    # The job capacity is held for is counted, never named: it may be another tenant's.
    assert "held for 1 job ahead in line" in decisions.reason_for("c1") and "a1" not in decisions.reason_for("c1")


def test_a_non_preemptible_gang_may_not_borrow():
    cluster = snapshot(8, [tenant("ml-a", 2, 8)], [], [gang("a1", "ml-a", 3, preemptible=False)])
    decisions = decide(cluster, NOW_S)
    assert decisions.admitted_ids == ()
    assert "non-preemptible job must fit in tenant ml-a's guarantee" in decisions.reason_for("a1")


def test_a_gang_bigger_than_the_tenants_max_is_blocked_for_good():
    decisions = decide(snapshot(16, [tenant("ml-a", 4, 8)], [], [gang("a1", "ml-a", 9)]), NOW_S)
    assert decisions.reason_for("a1").startswith("Blocked: it needs 9 H100-80GB but tenant ml-a's max is 8")


def test_a_gang_bigger_than_the_cluster_is_blocked_for_good():
    decisions = decide(snapshot(4, [tenant("ml-a", 4, 8)], [], [gang("a1", "ml-a", 6)]), NOW_S)
    assert decisions.reason_for("a1") == (
        "Blocked: it needs 6 H100-80GB but the whole cluster has 4 now; make the job smaller, or wait until "
        "capacity comes back."
    )


def test_a_flavor_without_quota_is_blocked():
    cluster = AdmissionSnapshot({H100: 8, MIG: 7}, (tenant("ml-a", 4, 8),), (), (PendingGang("a1", "ml-a", {MIG: 1}),))
    assert "has no quota for H100-80GB/mig-1g.10gb" in decide(cluster, NOW_S).reason_for("a1")


def test_a_tenant_without_quota_is_blocked():
    decisions = decide(snapshot(8, [tenant("ml-a", 4, 8)], [], [gang("x1", "ml-x", 1)]), NOW_S)
    assert decisions.reason_for("x1") == "Blocked: tenant ml-x has no quota; ask an admin to set one."


def test_every_pending_gang_is_either_admitted_or_has_a_reason():
    gangs = [
        gang(f"g{i}", name, units)
        for i, (name, units) in enumerate([("ml-a", 3), ("ml-b", 5), ("ml-a", 9), ("ml-c", 1)])
    ]
    decisions = decide(snapshot(8, [tenant("ml-a", 4, 8), tenant("ml-b", 4, 8)], [], gangs), NOW_S)
    assert sorted(decisions.admitted_ids + tuple(w.gang_id for w in decisions.waiting)) == ["g0", "g1", "g2", "g3"]


def test_a_gang_within_guarantee_goes_before_a_borrowing_one_with_a_lower_share():
    cluster = snapshot(
        8,
        [tenant("ml-a", 6, 8), tenant("ml-b", 0, 8)],
        [running("a-old", "ml-a", 4), running("c-old", "ml-c", 2)],
        [gang("b1", "ml-b", 2, submitted_at_s=0), gang("a1", "ml-a", 2, submitted_at_s=9)],
    )
    decisions = decide(cluster, NOW_S)
    assert decisions.admitted_ids == ("a1",)


def test_a_gang_past_guarantee_in_one_flavor_borrows_only_that_flavor():
    cluster = AdmissionSnapshot(
        {H100: 8, MIG: 14},
        (TenantQuota("ml-a", {H100: FlavorQuota(4, 8), MIG: FlavorQuota(2, 14)}),),
        (),
        (PendingGang("a1", "ml-a", {H100: 4, MIG: 5}),),
    )
    [admission] = decide(cluster, NOW_S).admitted
    assert not admission.within_guarantee
    assert dict(admission.borrowed_units_by_flavor) == {MIG: 3}


# --- preemption ------------------------------------------------------------------


def test_it_preempts_borrowed_work_to_give_a_tenant_back_its_guarantee():
    cluster = snapshot(
        8,
        [tenant("ml-a", 4, 8), tenant("ml-b", 4, 8)],
        [running("b-own", "ml-b", 4, started_at_s=0), running("b-borrowed", "ml-b", 4, started_at_s=10)],
        [gang("a1", "ml-a", 4)],
    )
    decisions = decide(cluster, NOW_S, grace_period_s=120)
    assert decisions.preempted_ids == ("b-borrowed",)
    preemption = decisions.preemptions[0]
    assert preemption.deadline_s == NOW_S + 120
    assert preemption.for_gang_id == "a1"
    assert preemption.reason == (
        "tenant ml-b is borrowing H100-80GB beyond its guarantee and tenant ml-a needs its guarantee back"
    )
    # It starts once the victim has checkpointed and stopped; until then its claim is held.
    assert decisions.admitted_ids == ()
    [reservation] = decisions.reservations
    assert (reservation.gang_id, reservation.kind, reservation.projected_start_s) == ("a1", "guarantee", NOW_S + 120)
    assert dict(reservation.held_units_by_flavor) == {H100: 4}


def test_borrowing_never_preempts_anyone():
    cluster = snapshot(
        8, [tenant("ml-a", 0, 8), tenant("ml-b", 0, 8)], [running("b1", "ml-b", 8)], [gang("a1", "ml-a", 4)]
    )
    assert decide(cluster, NOW_S).preemptions == ()


def test_it_never_preempts_work_within_its_tenants_guarantee():
    # Guarantees are oversubscribed (6 + 4 > 8): b is inside its guarantee, so a must wait.
    cluster = snapshot(
        8, [tenant("ml-a", 6, 8), tenant("ml-b", 4, 8)], [running("b1", "ml-b", 4)], [gang("a1", "ml-a", 6)]
    )
    decisions = decide(cluster, NOW_S)
    assert decisions.preemptions == ()
    assert decisions.reason_for("a1").startswith("Waiting: only 4 H100-80GB free, it needs 6")


def test_lower_priority_borrowed_work_is_preempted_first():
    cluster = snapshot(
        8,
        [tenant("ml-a", 4, 8), tenant("ml-b", 0, 8, max_priority=9)],
        [
            running("b-high", "ml-b", 2, priority=9, started_at_s=20),
            running("b-low", "ml-b", 2, priority=1, started_at_s=10),
            running("b-rest", "ml-b", 4, priority=5),
        ],
        [gang("a1", "ml-a", 2)],
    )
    assert decide(cluster, NOW_S).preempted_ids == ("b-low",)


def test_among_equal_priorities_the_newest_is_preempted_first():
    cluster = snapshot(
        8,
        [tenant("ml-a", 4, 8), tenant("ml-b", 0, 8)],
        [
            running("b-old", "ml-b", 2, started_at_s=10),
            running("b-new", "ml-b", 2, started_at_s=20),
            running("b-rest", "ml-b", 4),
        ],
        [gang("a1", "ml-a", 2)],
    )
    assert decide(cluster, NOW_S).preempted_ids == ("b-new",)


def test_wholly_borrowed_work_goes_before_work_only_partly_borrowed():
    # b is guaranteed 3: b-part (4 units) is only one unit past it, b-whole is all borrowed.
    cluster = snapshot(
        8,
        [tenant("ml-a", 2, 8), tenant("ml-b", 3, 8)],
        [
            running("b-part", "ml-b", 4, priority=0, started_at_s=0),
            running("b-whole", "ml-b", 4, priority=0, started_at_s=1),
        ],
        [gang("a1", "ml-a", 2)],
    )
    assert decide(cluster, NOW_S).preempted_ids == ("b-whole",)


def test_it_never_preempts_work_inside_its_minimum_runtime():
    cluster = snapshot(
        8,
        [tenant("ml-a", 4, 8), tenant("ml-b", 0, 8)],
        [
            running("b-young", "ml-b", 4, started_at_s=NOW_S - 60, min_runtime_s=600),
            running("b-old", "ml-b", 4, started_at_s=0, min_runtime_s=600),
        ],
        [gang("a1", "ml-a", 4)],
    )
    assert decide(cluster, NOW_S).preempted_ids == ("b-old",)


def test_it_never_preempts_non_preemptible_work_and_says_why_the_gang_waits():
    cluster = snapshot(
        8,
        [tenant("ml-a", 4, 8), tenant("ml-b", 0, 8)],
        [running("b-pinned", "ml-b", 8, preemptible=False)],
        [gang("a1", "ml-a", 4)],
    )
    decisions = decide(cluster, NOW_S)
    assert decisions.preemptions == ()
    assert "other tenants' borrowed work cannot be preempted yet (8 H100-80GB" in decisions.reason_for("a1")


def test_it_preempts_nothing_when_the_eligible_work_cannot_cover_the_shortfall():
    cluster = snapshot(
        8,
        [tenant("ml-a", 4, 8), tenant("ml-b", 0, 8)],
        [running("b-ok", "ml-b", 2), running("b-young", "ml-b", 6, started_at_s=NOW_S - 1, min_runtime_s=600)],
        [gang("a1", "ml-a", 4)],
    )
    decisions = decide(cluster, NOW_S)
    assert decisions.preemptions == ()
    assert "cannot be preempted yet (6 H100-80GB non-preemptible or inside its minimum runtime)" in (
        decisions.reason_for("a1")
    )


def test_it_preempts_a_minimal_set():
    # Greedy by priority takes the 1-unit job first, but the 4-unit job alone is enough.
    cluster = snapshot(
        8,
        [tenant("ml-a", 4, 8), tenant("ml-b", 0, 8, max_priority=9)],
        [
            running("b-small", "ml-b", 1, priority=0),
            running("b-big", "ml-b", 4, priority=5),
            running("b-rest", "ml-b", 3, priority=9),
        ],
        [gang("a1", "ml-a", 4)],
    )
    assert decide(cluster, NOW_S).preempted_ids == ("b-big",)


def test_work_already_stopping_is_not_preempted_again_nor_replaced_by_more_victims():
    cluster = snapshot(
        8,
        [tenant("ml-a", 4, 8), tenant("ml-b", 0, 8)],
        [running("b-stopping", "ml-b", 4, stopping_deadline_s=NOW_S + 50), running("b-other", "ml-b", 4)],
        [gang("a1", "ml-a", 4)],
    )
    decisions = decide(cluster, NOW_S)
    assert decisions.preemptions == ()
    [reservation] = decisions.reservations
    assert (reservation.kind, reservation.projected_start_s) == ("guarantee", NOW_S + 50)


def test_the_claimant_starts_in_the_cycle_after_its_victims_have_stopped():
    tenants = [tenant("ml-a", 4, 8), tenant("ml-b", 4, 8)]
    b_own = running("b-own", "ml-b", 4, started_at_s=0)
    b_borrowed = running("b-borrowed", "ml-b", 4, started_at_s=10)
    pending = [gang("a1", "ml-a", 4), gang("b2", "ml-b", 2)]
    first = decide(snapshot(8, tenants, [b_own, b_borrowed], pending), NOW_S, grace_period_s=60)
    assert first.preempted_ids == ("b-borrowed",)
    # The cycle after the deadline no longer sees the victim; the claimant starts, b's new gang cannot borrow.
    later = decide(snapshot(8, tenants, [b_own], pending), NOW_S + 61, grace_period_s=60)
    assert later.admitted_ids == ("a1",)
    assert later.admitted[0].within_guarantee
    assert later.preemptions == ()


def test_a_short_gang_may_backfill_capacity_held_for_a_guarantee_claim_until_the_victims_stop():
    cluster = snapshot(
        8,
        [tenant("ml-a", 4, 8), tenant("ml-b", 0, 8), tenant("ml-c", 0, 8)],
        [running("b-borrowed", "ml-b", 6)],
        [
            gang("a1", "ml-a", 4),
            gang("c-short", "ml-c", 2, estimated_runtime_s=100),
            gang("c-long", "ml-c", 2, estimated_runtime_s=1000),
        ],
    )
    decisions = decide(cluster, NOW_S, grace_period_s=300)
    assert decisions.preempted_ids == ("b-borrowed",)
    assert decisions.admitted_ids == ("c-short",)
    assert decisions.admitted[0].backfilled


def test_victims_come_only_from_tenants_that_borrow_in_the_short_flavor():
    cluster = AdmissionSnapshot(
        {H100: 4, MIG: 7},
        (
            TenantQuota("ml-a", {H100: FlavorQuota(2, 4), MIG: FlavorQuota(0, 7)}),
            TenantQuota("ml-b", {H100: FlavorQuota(2, 4), MIG: FlavorQuota(0, 7)}),
        ),
        (
            RunningWorkload("b-mig", "ml-b", {MIG: 7}, started_at_s=50),
            RunningWorkload("b-h100", "ml-b", {H100: 2}, started_at_s=0),
            RunningWorkload("b-h100-borrowed", "ml-b", {H100: 2}, started_at_s=10),
        ),
        (PendingGang("a1", "ml-a", {H100: 2}),),
    )
    assert decide(cluster, NOW_S).preempted_ids == ("b-h100-borrowed",)


def test_the_newest_work_is_the_borrowed_work():
    quotas = {"ml-b": tenant("ml-b", 4, 8)}
    workloads = [
        running("b1", "ml-b", 3, started_at_s=0),
        running("b2", "ml-b", 3, started_at_s=5),
        running("b3", "ml-b", 2, started_at_s=9),
    ]
    assert borrowed_units(workloads, quotas) == {"b2": {H100: 2}, "b3": {H100: 2}}


def test_choose_victims_never_picks_the_claimants_own_work():
    quotas = {"ml-a": tenant("ml-a", 0, 8)}
    choice = choose_victims(
        shortfall_units_by_flavor={H100: 2},
        claimant_tenant="ml-a",
        live_workloads=[running("a-borrowed", "ml-a", 4)],
        quotas_by_tenant=quotas,
        now_s=NOW_S,
    )
    assert not choice.covers


# --- reservations and backfill ----------------------------------------------------


def large_gang_behind_running_work(small_gang):
    return snapshot(
        8,
        [tenant("ml-a", 0, 8), tenant("ml-b", 0, 8)],
        [running("b-running", "ml-b", 6, started_at_s=0, estimated_runtime_s=NOW_S + 500)],
        [gang("a-large", "ml-a", 8, submitted_at_s=1), small_gang],
    )


def test_a_large_gang_that_cannot_fit_gets_a_reservation_with_a_projected_start():
    decisions = decide(large_gang_behind_running_work(gang("b-small", "ml-b", 1, submitted_at_s=2)), NOW_S)
    reservation = decisions.reservations[0]
    assert (reservation.gang_id, reservation.kind) == ("a-large", "capacity")
    assert dict(reservation.held_units_by_flavor) == {H100: 2}
    assert reservation.projected_start_s == NOW_S + 500
    assert "what frees up is reserved for it" in decisions.reason_for("a-large")


def test_a_small_gang_that_would_delay_the_reserved_one_does_not_backfill():
    decisions = decide(large_gang_behind_running_work(gang("b-small", "ml-b", 1, submitted_at_s=2)), NOW_S)
    assert decisions.admitted_ids == ()
    assert "held for 1 job ahead in line" in decisions.reason_for("b-small")


def test_a_small_gang_that_ends_before_the_projected_start_backfills():
    decisions = decide(
        large_gang_behind_running_work(gang("b-small", "ml-b", 2, submitted_at_s=2, estimated_runtime_s=400)), NOW_S
    )
    assert decisions.admitted_ids == ("b-small",)
    assert decisions.admitted[0].backfilled


def test_a_small_gang_that_ends_after_the_projected_start_does_not_backfill():
    decisions = decide(
        large_gang_behind_running_work(gang("b-small", "ml-b", 2, submitted_at_s=2, estimated_runtime_s=600)), NOW_S
    )
    assert decisions.admitted_ids == ()


def test_a_small_gang_fits_in_capacity_the_reserved_gang_does_not_need():
    cluster = AdmissionSnapshot(
        {H100: 8, MIG: 7},
        (
            TenantQuota("ml-a", {H100: FlavorQuota(0, 8)}),
            TenantQuota("ml-b", {H100: FlavorQuota(0, 8), MIG: FlavorQuota(0, 7)}),
        ),
        (running("b-running", "ml-b", 6),),
        (gang("a-large", "ml-a", 8, submitted_at_s=1), PendingGang("b-mig", "ml-b", {MIG: 3}, submitted_at_s=2)),
    )
    decisions = decide(cluster, NOW_S)
    assert decisions.admitted_ids == ("b-mig",)
    assert not decisions.admitted[0].backfilled


def test_without_estimates_the_projected_start_is_unknown_and_nothing_backfills():
    cluster = snapshot(
        8,
        [tenant("ml-a", 0, 8), tenant("ml-b", 0, 8)],
        [running("b-running", "ml-b", 6)],
        [
            gang("a-large", "ml-a", 8, submitted_at_s=1),
            gang("b-small", "ml-b", 1, submitted_at_s=2, estimated_runtime_s=1),
        ],
    )
    decisions = decide(cluster, NOW_S)
    assert decisions.reservations[0].projected_start_s is None
    assert decisions.admitted_ids == ()


def test_only_max_reservations_borrowing_gangs_hold_capacity():
    cluster = snapshot(
        8,
        [tenant("ml-a", 0, 8), tenant("ml-b", 0, 8), tenant("ml-c", 0, 8)],
        [running("c-running", "ml-c", 6)],
        [gang("a-large", "ml-a", 8), gang("b-large", "ml-b", 7)],
    )
    assert [r.gang_id for r in decide(cluster, NOW_S).reservations] == ["a-large"]
    assert [r.gang_id for r in decide(cluster, NOW_S, max_reservations=0).reservations] == []


# --- input checks -------------------------------------------------------------------


def test_it_refuses_a_guarantee_above_max():
    with pytest.raises(ValueError, match="guaranteed_units <= max_units"):
        FlavorQuota(9, 8)


def test_it_refuses_fractional_units():
    with pytest.raises(ValueError, match="whole number of units"):
        PendingGang("a1", "ml-a", {H100: 0.5})


def test_it_refuses_a_snapshot_with_a_repeated_gang_id():
    with pytest.raises(ValueError, match="each pending gang must appear once"):
        snapshot(8, [tenant("ml-a", 4, 8)], [], [gang("a1", "ml-a", 1), gang("a1", "ml-a", 2)])


def test_reasons_hold_no_clock_time_the_reservation_does():
    cluster = snapshot(
        8,
        [tenant("ml-a", 4, 8), tenant("ml-b", 0, 8)],
        [running("b1", "ml-b", 8, started_at_s=1_700_000_000.0)],
        [gang("a1", "ml-a", 4)],
    )
    decisions = decide(cluster, 1_700_000_000.0 + 3600, grace_period_s=300)
    assert decisions.reason_for("a1") == (
        "Waiting: other tenants' borrowed work is checkpointing and stopping to give tenant ml-a back its "
        "guarantee (4 H100-80GB); it starts as soon as that work has stopped."
    )
    assert "1700003900" not in decisions.preemptions[0].reason
    assert decisions.reservations[0].projected_start_s == 1_700_003_900.0
