"""The autoscaler's rule on its own: out on sustained load, in only after a quiet window, warm on top, zero when idle."""

import pytest

from runners.inference.autoscale import Bounds, Load, Policy, decide

pytestmark = pytest.mark.unit

POLICY = Policy(target_inflight=8, scale_in_after_s=30, idle_after_s=120)


def run(loads, bounds, *, current=1, policy=POLICY):
    """Feed samples (at_s, inflight[, shed_per_s[, since_last_request_s]]) and return the wanted count after each."""
    history, last_change, wanted = [], None, []
    for sample in loads:
        at, inflight, shed, idle = (*sample, 0.0, 0.0)[:4]
        count, why, history = decide(history, Load(at, inflight, shed, idle), bounds, policy, current=current,
                                     last_change_s=last_change)
        if count != current:
            assert why, "every change carries its reason"
            current, last_change = count, at
        wanted.append(current)
    return wanted


def test_sustained_load_scales_out_to_what_it_needs_but_one_spike_does_not():
    bounds = Bounds(1, 8)
    assert run([(0, 40), (2, 2), (4, 2)], bounds) == [1, 1, 1]  # a single spike: no change
    assert run([(0, 40), (2, 40)], bounds) == [1, 5]  # two samples running: straight to ceil(40 / 8)
    assert run([(0, 400), (2, 400)], bounds) == [1, 8]  # never past max


def test_shed_requests_scale_out_at_once():
    assert run([(0, 0, 5.0)], Bounds(1, 4)) == [2]


def test_scale_in_waits_for_a_whole_quiet_window_and_takes_its_peak():
    bounds = Bounds(1, 8)
    samples = [(0, 40), (2, 40)] + [(t, 12) for t in range(4, 60, 2)]
    wanted = run(samples, bounds)
    assert wanted[1] == 5
    first_in = next(i for i, count in enumerate(wanted) if i > 1 and count < 5)
    assert samples[first_in][0] >= 2 + 30  # not before the window since the last change
    assert wanted[-1] == 2  # ceil(12 / 8): the most any sample of the window needed


def test_a_load_at_the_edge_never_flaps():
    """In-flight bouncing around one replica's target: once out, the window's peak keeps it there."""
    samples = [(t, 9 if (t // 4) % 2 else 7) for t in range(0, 300, 2)]  # two samples over, two under
    wanted = run(samples, Bounds(1, 8))
    changes = sum(1 for a, b in zip(wanted, wanted[1:]) if a != b)
    assert changes <= 1, wanted


def test_warm_replicas_sit_on_top_of_the_need_within_bounds():
    assert run([(0, 40), (2, 40)], Bounds(1, 8, warm_replicas=2)) == [1, 7]
    assert run([(0, 40), (2, 40)], Bounds(1, 6, warm_replicas=2)) == [1, 6]


def test_idle_scales_to_zero_only_with_min_zero_and_a_request_wakes_it():
    idle = [(t, 0, 0.0, 200.0) for t in range(0, 40, 2)]
    assert run(idle, Bounds(0, 4))[-1] == 0
    assert run(idle, Bounds(1, 4))[-1] == 1  # min holds
    assert run(idle, Bounds(0, 4, warm_replicas=1))[-1] == 1  # warm holds one ready even with no traffic
    # Scaled to zero, the first request (since_last_request 0) brings one back at once.
    assert run([(0, 0, 0.0, 0.0)], Bounds(0, 4), current=0) == [1]
