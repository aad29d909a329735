"""Weighted dominant-resource share and the pending-gang order key."""

import pytest

from runners.scheduler.fairshare import dominant_share, gang_order_key, weighted_dominant_share

pytestmark = pytest.mark.unit

H100 = "H100-80GB"
MIG = "H100-80GB/mig-1g.10gb"


def test_the_dominant_share_is_the_largest_fraction_of_any_flavor():
    assert dominant_share({H100: 2, MIG: 21}, {H100: 8, MIG: 28}) == pytest.approx(0.75)


def test_no_usage_has_no_share():
    assert dominant_share({}, {H100: 8}) == 0.0


def test_a_flavor_the_cluster_lacks_does_not_make_the_share_infinite():
    assert dominant_share({"A100-40GB": 4, H100: 2}, {H100: 8}) == pytest.approx(0.25)


def test_a_larger_weight_gives_a_smaller_share_for_the_same_usage():
    assert weighted_dominant_share({H100: 4}, {H100: 8}, 2.0) == pytest.approx(0.25)


def test_it_refuses_a_weight_that_is_not_positive():
    with pytest.raises(ValueError, match="weight must be > 0"):
        weighted_dominant_share({H100: 4}, {H100: 8}, 0)


def test_within_guarantee_sorts_before_a_lower_share_that_borrows():
    within = gang_order_key(borrowing=False, tenant_share=0.9, priority=0, submitted_at_s=5, gang_id="b")
    borrowing = gang_order_key(borrowing=True, tenant_share=0.0, priority=9, submitted_at_s=0, gang_id="a")
    assert within < borrowing


def test_ties_fall_to_priority_then_submission_then_id():
    def key(priority, submitted_at_s, gang_id):
        return gang_order_key(
            borrowing=False, tenant_share=0.5, priority=priority, submitted_at_s=submitted_at_s, gang_id=gang_id
        )

    assert sorted([key(0, 1, "c"), key(5, 9, "d"), key(0, 1, "b"), key(0, 0, "z")]) == [
        key(5, 9, "d"),
        key(0, 0, "z"),
        key(0, 1, "b"),
        key(0, 1, "c"),
    ]
