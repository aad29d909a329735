"""The loss series a job's page and the metrics API draw: chosen among the rows recorded, not by step arithmetic.

A script using the SDK records sparse metric lines (about one a second, plus one per checkpoint), the
shipped trainer one a step; both must reach the chart whole while they fit under the cap, and as an
even spread of the recorded rows once they do not.
"""

import random

import pytest

from runners.jobs import selectors as job_selectors
from runners.jobs import services as jobs
from runners.jobs.models import JobMetric
from tests.support.jobs import give_quota, job_data, ready_environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def environment(flavors, tenant, owner):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16)
    return ready_environment(actor=owner, tenant=tenant)


@pytest.fixture
def job(owner, environment):
    return jobs.job_submit(actor=owner, data=job_data(environment))


def _record(job, steps, attempt=1):
    JobMetric.objects.bulk_create(
        [JobMetric(job=job, attempt=attempt, step=step, loss=attempt * 1000.0 + step, at=f"t{step}") for step in steps],
        batch_size=10_000,
    )


def _sparse_steps(count, span, seed=34):
    """`count` steps at irregular places in 1..span, the first and the last among them, sorted."""
    middle = random.Random(seed).sample(range(2, span), count - 2)
    return sorted([1, *middle, span])


def _gaps(chosen, recorded):
    """How many recorded rows lie between each two chosen ones (each chosen must be a recorded row)."""
    where = [recorded.index(step) for step in chosen]
    return [b - a for a, b in zip(where, where[1:], strict=False)]


def test_a_sparse_series_under_the_cap_comes_back_whole(job, django_assert_num_queries):
    steps = _sparse_steps(81, 4000)
    _record(job, steps)
    with django_assert_num_queries(1):
        found = job_selectors.job_metric_series(job, points=job_selectors.CHART_POINTS)
    assert [point["step"] for point in found["series"]] == steps
    assert all(point["loss"] == 1000.0 + point["step"] and point["time"] == f"t{point['step']}"
               for point in found["series"])
    assert (found["first_step"], found["last_step"], found["steps_recorded"]) == (1, 4000, 4000)


@pytest.mark.parametrize("points", [2, 10, 33, 80])
def test_a_sparse_series_over_the_cap_is_an_even_spread_of_its_rows(job, points):
    steps = _sparse_steps(81, 4000)
    _record(job, steps)
    chosen = [point["step"] for point in job_selectors.job_metric_series(job, points=points)["series"]]
    assert len(chosen) == points
    assert chosen[0] == steps[0] and chosen[-1] == steps[-1]
    gaps = _gaps(chosen, steps)
    # 80 rows between the first and the last, shared out as evenly as whole rows allow.
    assert set(gaps) <= {80 // (points - 1), -(-80 // (points - 1))} and sum(gaps) == 80


def test_a_dense_series_is_thinned_as_before(job, django_assert_num_queries):
    _record(job, range(1, 100_001))
    with django_assert_num_queries(1):
        found = job_selectors.job_metric_series(job, points=100)
    chosen = [point["step"] for point in found["series"]]
    assert len(chosen) == 100 and chosen[0] == 1 and chosen[-1] == 100_000
    assert {b - a for a, b in zip(chosen, chosen[1:], strict=False)} <= {99_999 // 99, 99_999 // 99 + 1}
    assert found["steps_recorded"] == 100_000
    whole = job_selectors.job_metric_series(job, points=100, first_step=500, last_step=599)
    assert [point["step"] for point in whole["series"]] == list(range(500, 600))


def test_a_step_trained_twice_counts_once_with_the_newest_attempts_row(job):
    steps = _sparse_steps(30, 900)
    _record(job, steps, attempt=1)
    again = [step for step in steps if step >= 300]
    _record(job, again, attempt=2)
    found = job_selectors.job_metric_series(job, points=30)["series"]
    assert [point["step"] for point in found] == steps
    assert [point["attempt"] for point in found] == [2 if step >= 300 else 1 for step in steps]
    assert all(point["loss"] == point["attempt"] * 1000.0 + point["step"] for point in found)
    # Over the cap the repeated steps are numbered once: the spread is over the 30 steps, not 30 + the repeats.
    chosen = [point["step"] for point in job_selectors.job_metric_series(job, points=4)["series"]]
    assert sorted(_gaps(chosen, steps)) == [9, 10, 10]


def test_a_zoom_keeps_only_the_rows_in_its_range_and_one_point_is_the_newest(job):
    steps = _sparse_steps(81, 4000)
    _record(job, steps)
    inside = [step for step in steps if 1000 <= step <= 2500]
    found = job_selectors.job_metric_series(job, points=400, first_step=1000, last_step=2500)
    assert [point["step"] for point in found["series"]] == inside
    assert (found["first_step"], found["last_step"]) == (inside[0], inside[-1])
    assert [point["step"] for point in job_selectors.job_metric_series(job, points=1)["series"]] == [4000]
    empty = job_selectors.job_metric_series(job, first_step=4001)
    assert empty == {"series": [], "steps_recorded": 0, "first_step": None, "last_step": None}


def test_another_jobs_rows_are_not_in_the_series(owner, environment, job, client_for):
    other = jobs.job_submit(actor=owner, data=job_data(environment, name="other"))
    _record(job, [10, 20, 30])
    _record(other, [15, 25, 35, 45])
    body = client_for(owner).get(f"/api/v1/jobs/{job.id}/metrics/?points=2").json()
    assert [point["step"] for point in body["series"]] == [10, 30]
    body = client_for(owner).get(f"/api/v1/jobs/{job.id}/metrics/").json()
    assert [point["step"] for point in body["series"]] == [10, 20, 30]
