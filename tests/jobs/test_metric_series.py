"""The loss series a job's page and the metrics API draw: chosen among the rows recorded, not by step arithmetic.

A script using the SDK records sparse metric lines (about one a second, plus one per checkpoint), the
shipped trainer one a step; both must reach the chart whole while they fit under the cap, and once they do
not as recorded steps spread evenly over the range (for the trainer's, the steps step arithmetic gives).
"""

import math
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


def _sparse_steps(count, seed=34):
    """`count` steps from 1 at irregular gaps of 1 to 99 steps, as a script's lines come."""
    rng = random.Random(seed)
    steps = [1]
    while len(steps) < count:
        steps.append(steps[-1] + rng.randint(1, 99))
    return steps


def _runs(steps, points):
    """The range of `steps` cut into runs of equal length, at most points - 1 of them: each run's steps."""
    low, high = steps[0], steps[-1]
    stride = math.ceil((high - low + 1) / (points - 1))
    return [[step for step in steps if start <= step < start + stride] for start in range(low, high + 1, stride)]


def test_a_sparse_series_under_the_cap_comes_back_whole(job, django_assert_num_queries):
    steps = _sparse_steps(81)
    _record(job, steps)
    with django_assert_num_queries(1):
        found = job_selectors.job_metric_series(job, points=job_selectors.CHART_POINTS)
    assert [point["step"] for point in found["series"]] == steps
    assert all(point["loss"] == 1000.0 + point["step"] and point["time"] == f"t{point['step']}"
               for point in found["series"])
    assert (found["first_step"], found["last_step"], found["steps_recorded"]) == (1, steps[-1], steps[-1])
    assert len(job_selectors.job_metric_series(job, points=81)["series"]) == 81


@pytest.mark.parametrize("points", [2, 10, 33, 80])
def test_a_sparse_series_over_the_cap_is_spread_evenly_over_its_steps(job, points, django_assert_num_queries):
    steps = _sparse_steps(81)
    _record(job, steps)
    with django_assert_num_queries(1):
        chosen = [point["step"] for point in job_selectors.job_metric_series(job, points=points)["series"]]
    assert len(chosen) <= points and chosen == sorted(set(chosen)) and set(chosen) <= set(steps)
    assert chosen[0] == steps[0] and chosen[-1] == steps[-1]
    # One recorded step from each equal run of steps that has any (the first), and the last step.
    runs = _runs(steps, points)
    assert sorted({*(run[0] for run in runs if run), steps[-1]}) == chosen
    assert len(chosen) >= points // 2, "a run of steps too long for one line (99 steps) is never empty"


def test_a_cluster_of_rows_does_not_take_the_chart(job):
    """A burst of lines (say, one per batch early on) and sparse ones after: the points cover the whole run."""
    steps = [*range(1, 301), *range(400, 1_000_000, 5_000)]
    _record(job, steps)
    chosen = [point["step"] for point in job_selectors.job_metric_series(job, points=100)["series"]]
    assert sum(step <= 300 for step in chosen) == 1
    assert len(chosen) == 100 and chosen[-1] == steps[-1]
    assert max(b - a for a, b in zip(chosen, chosen[1:], strict=False)) < 2 * math.ceil(steps[-1] / 99)


def test_a_dense_series_is_thinned_as_before(job, django_assert_num_queries):
    _record(job, range(1, 100_001))
    with django_assert_num_queries(1):
        found = job_selectors.job_metric_series(job, points=100)
    stride = math.ceil(100_000 / 99)
    assert [point["step"] for point in found["series"]] == [*range(1, 100_001, stride), 100_000]
    assert found["steps_recorded"] == 100_000
    whole = job_selectors.job_metric_series(job, points=100, first_step=500, last_step=599)
    assert [point["step"] for point in whole["series"]] == list(range(500, 600))


def test_a_step_trained_twice_counts_once_with_the_newest_attempts_row(job):
    steps = _sparse_steps(30)
    _record(job, steps, attempt=1)
    _record(job, [step for step in steps if step >= 300], attempt=2)
    for points in (400, 30, 4):
        found = job_selectors.job_metric_series(job, points=points)["series"]
        if points >= 30:  # the repeats are one step each: 30 steps fit 30 points
            assert [point["step"] for point in found] == steps
        assert all(point["attempt"] == (2 if point["step"] >= 300 else 1) for point in found)
        assert all(point["loss"] == point["attempt"] * 1000.0 + point["step"] for point in found)


def test_a_zoom_keeps_only_the_rows_in_its_range_and_one_point_is_the_newest(job):
    steps = _sparse_steps(81)
    _record(job, steps)
    inside = [step for step in steps if 1000 <= step <= 2500]
    found = job_selectors.job_metric_series(job, points=400, first_step=1000, last_step=2500)
    assert [point["step"] for point in found["series"]] == inside
    assert (found["first_step"], found["last_step"]) == (inside[0], inside[-1])
    assert [point["step"] for point in job_selectors.job_metric_series(job, points=1)["series"]] == [steps[-1]]
    empty = job_selectors.job_metric_series(job, first_step=steps[-1] + 1)
    assert empty == {"series": [], "steps_recorded": 0, "first_step": None, "last_step": None}


def test_another_jobs_rows_are_not_in_the_series(owner, environment, job, client_for):
    other = jobs.job_submit(actor=owner, data=job_data(environment, name="other"))
    _record(job, [10, 20, 30])
    _record(other, [15, 25, 35, 45])
    body = client_for(owner).get(f"/api/v1/jobs/{job.id}/metrics/?points=2").json()
    assert [point["step"] for point in body["series"]] == [10, 30]
    body = client_for(owner).get(f"/api/v1/jobs/{job.id}/metrics/").json()
    assert [point["step"] for point in body["series"]] == [10, 20, 30]
