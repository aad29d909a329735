"""Rules of the job path that hold without a worker: budgets, bounded reads, the schema against the spec check,
per-flavor caps, and where recorded progress is credited."""

from datetime import timedelta

import pytest
from django.utils import timezone

from common.errors import Invalid
from runners.backends.base import AttemptStatus, ProgressRead
from runners.jobs import attempts, reconcile
from runners.jobs import selectors as job_selectors
from runners.jobs import services as jobs
from runners.jobs.models import Checkpoint, Job, JobAttempt, JobMetric
from runners.scheduling import services as scheduling
from tests.support.jobs import give_quota, job_data, ready_environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def environment(flavors, tenant, owner):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16)
    return ready_environment(actor=owner, tenant=tenant)


def _post(client, data, **headers):
    return client.post("/api/v1/jobs/", data, format="json", **headers)


# --- Budgets ------------------------------------------------------------------------------


def test_steps_below_the_default_checkpoint_interval_are_accepted_with_an_interval_that_fits(owner, environment):
    job = jobs.job_submit(actor=owner, data={**job_data(environment, steps=20), "checkpoint_every_steps": None})
    assert job.spec["checkpoint_every_steps"] == 20
    job = jobs.job_submit(actor=owner, data={k: v for k, v in job_data(environment, name="b", steps=200).items()
                                             if k != "checkpoint_every_steps"})
    assert job.spec["checkpoint_every_steps"] == jobs.DEFAULT_CHECKPOINT_EVERY_STEPS


@pytest.mark.parametrize(("change", "field", "largest"), [
    ({"replicas": 1, "gpus_per_replica": 12}, "gpus_per_replica", "8"),  # the demo's H100 nodes have 8
    ({"replicas": 3, "gpus_per_replica": 4, "topology": {"level": "node", "mode": "required"}}, "replicas", "2"),
])
def test_a_gang_that_can_never_be_placed_is_refused_naming_the_largest_that_fits(
    client_for, owner, environment, tenant, flavors, change, field, largest
):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=64)
    response = _post(client_for(owner), job_data(environment, **change))
    assert response.status_code == 400, response.json()
    assert largest in response.json()[field][0]
    assert not Job.objects.exists()


def test_queued_jobs_past_the_tenant_cap_answer_429(client_for, owner, environment, settings):
    settings.JOB_QUEUED_MAX_PER_TENANT = 2
    client = client_for(owner)
    assert _post(client, job_data(environment, name="a")).status_code == 201
    assert _post(client, job_data(environment, name="b")).status_code == 201
    response = _post(client, job_data(environment, name="c"))
    assert response.status_code == 429
    assert "JOB_QUEUED_MAX_PER_TENANT" in response.json()["detail"]
    assert Job.objects.count() == 2


def _running(owner, environment, **overrides):
    """A job admitted and marked started without a process: the rules below read only the rows."""
    job = jobs.job_submit(actor=owner, data=job_data(environment, **overrides))
    scheduling.cycle_run()
    job.refresh_from_db()
    attempt = job.attempts.get()
    JobAttempt.objects.filter(id=attempt.id).update(started_at=timezone.now())
    jobs.transition(job, "launching", "test")
    jobs.transition(job, "running", "test")
    attempt.refresh_from_db()
    return job, attempt


def test_a_pinned_job_that_is_cancelled_or_fails_gives_its_pin_back(owner, environment):
    until = timezone.now() + timedelta(minutes=5)
    pin = [{"replica": 0, "node": "gpu-a", "gpus": [3]}]
    moved, _ = _running(owner, environment)
    assert jobs.transition(moved, "preempted", "Moved to make room.")
    Job.objects.filter(id=moved.id).update(pinned_placement=pin, pinned_until=until)
    moved.refresh_from_db()
    assert jobs.transition(moved, "cancelling", "Cancelled by its owner.")
    waiting = jobs.job_submit(actor=owner, data=job_data(environment, name="waiting"))
    Job.objects.filter(id=waiting.id).update(pinned_placement=pin, pinned_until=until)
    waiting.refresh_from_db()
    assert jobs.transition(waiting, "failed", "Its environment went away.")
    for job in (moved, waiting):
        job.refresh_from_db()
        assert (job.pinned_placement, job.pinned_until) == (None, None), job.state
    # Preempted (moved) and queued again, a job keeps its pin for the admission that uses it.
    kept, _ = _running(owner, environment, name="kept")
    Job.objects.filter(id=kept.id).update(pinned_placement=pin, pinned_until=until)
    kept.refresh_from_db()
    assert jobs.transition(kept, "preempted", "Moved to make room.")
    assert jobs.transition(kept, "queued", "Stopped: waiting for its place.")
    kept.refresh_from_db()
    assert kept.pinned_placement == pin


def test_a_spent_runtime_budget_fails_the_job_without_a_retry(owner, environment):
    job, attempt = _running(owner, environment, max_runtime_s=10, max_retries=3)
    # Its trainer took its first step 11 s ago: the budget counts from there, across attempts.
    JobAttempt.objects.filter(id=attempt.id).update(first_step_at=timezone.now() - timezone.timedelta(seconds=11))
    assert attempts.attempt_end(job.id, attempt.id, status=AttemptStatus("exited", {0: 75, 1: 75}))
    job.refresh_from_db()
    assert job.state == "failed" and "max_runtime_s" in job.reason
    assert job.attempts.count() == 1, "no retry once the budget is spent"


def test_the_budget_left_for_a_relaunch_is_what_earlier_attempts_did_not_use(owner, environment):
    job, attempt = _running(owner, environment, max_runtime_s=100)
    now = timezone.now()
    JobAttempt.objects.filter(id=attempt.id).update(
        first_step_at=now - timezone.timedelta(seconds=30), ended_at=now, outcome="preempted")
    # Import time before the first step does not count: only first_step_at -> ended_at.
    JobAttempt.objects.filter(id=attempt.id).update(started_at=now - timezone.timedelta(seconds=90))
    assert 69 <= attempts.runtime_left_s(job) <= 70


# --- Where recorded progress is credited --------------------------------------------------


def test_checkpoints_are_credited_to_the_attempt_that_wrote_them(owner, environment):
    job, first = _running(owner, environment)
    second = JobAttempt.objects.create(job=job, number=2, placement=first.placement, started_at=timezone.now())

    class Reads:
        def job_progress(self, job_id, attempt, cursor):
            if cursor.get("done"):
                return ProgressRead(cursor=cursor)
            return ProgressRead(
                metrics=[{"step": 5, "loss": 2.0, "attempt": 1, "time": timezone.now().isoformat()}],
                checkpoints=[{"step": 5, "path": "checkpoints/step-5.pt", "bytes": 10, "attempt": 1},
                             {"step": 9, "path": "checkpoints/step-9.pt", "bytes": 10, "attempt": 2}],
                cursor={"done": True}, bytes_read=100,
            )

    attempts.progress_record(job, second, Reads())
    credited = dict(Checkpoint.objects.filter(job=job).values_list("step", "attempt__number"))
    assert credited == {5: 1, 9: 2}
    job.refresh_from_db()
    assert job.progress_cursor == {"done": True}
    assert JobMetric.objects.get(job=job).attempt == 1


# --- Bounded reads ------------------------------------------------------------------------


def _record_steps(job, count, attempt=1):
    JobMetric.objects.bulk_create(
        [JobMetric(job=job, attempt=attempt, step=step, loss=1.0 / step) for step in range(1, count + 1)],
        batch_size=10_000,
    )


@pytest.mark.parametrize("steps", [10, 200_000])
def test_the_metrics_answer_is_downsampled_and_reads_only_the_chosen_steps(
    client_for, owner, environment, django_assert_max_num_queries, steps
):
    job = jobs.job_submit(actor=owner, data=job_data(environment))
    _record_steps(job, steps)
    client = client_for(owner)
    with django_assert_max_num_queries(12):
        response = client.get(f"/api/v1/jobs/{job.id}/metrics/?points=100")
    body = response.json()
    assert response.status_code == 200
    assert len(body["series"]) == min(steps, 100)
    assert body["steps_recorded"] == steps
    assert body["series"][0]["step"] == 1 and body["series"][-1]["step"] == steps
    zoomed = client.get(f"/api/v1/jobs/{job.id}/metrics/?points=50&first_step=1000&last_step=1100").json()
    if steps > 1100:
        assert zoomed["first_step"] == 1000 and zoomed["last_step"] == 1100 and len(zoomed["series"]) <= 50


def test_the_newest_attempt_wins_for_a_repeated_step(owner, environment):
    job = jobs.job_submit(actor=owner, data=job_data(environment))
    JobMetric.objects.create(job=job, attempt=1, step=7, loss=3.0)
    JobMetric.objects.create(job=job, attempt=2, step=7, loss=2.0)
    assert [(p["attempt"], p["loss"]) for p in job_selectors.job_metric_series(job)["series"]] == [(2, 2.0)]


# --- The schema is the spec check's --------------------------------------------------------


def test_the_submit_schema_has_the_spec_checks_bounds_and_defaults(client_for, staff):
    schema = client_for(staff).get("/api/schema/?format=json").json()
    submit = schema["components"]["schemas"]["JobSubmitRequest"]["properties"]
    for field, (low, high) in jobs.BOUNDS.items():
        assert (submit[field].get("minimum"), submit[field].get("maximum")) == (low, high), field
        if jobs.DEFAULTS[field] is not None:
            assert submit[field]["default"] == jobs.DEFAULTS[field], field
    assert submit["name"]["maxLength"] == jobs.NAME_MAX
    topology = schema["components"]["schemas"]["TopologyRequest"]["properties"]
    assert topology["mode"]["default"] == jobs.DEFAULT_TOPOLOGY_MODE
    assert jobs.DEFAULTS["topology"]["mode"] == jobs.DEFAULT_TOPOLOGY_MODE


@pytest.mark.parametrize("field", sorted(jobs.BOUNDS))
def test_the_spec_check_refuses_just_past_each_bound_and_takes_each_bound(owner, environment, field):
    low, high = jobs.BOUNDS[field]
    for bad in (low - 1, high + 1):
        with pytest.raises(Invalid) as refused:
            jobs.job_spec_check(actor=owner, data=job_data(environment, **{field: bad}))
        assert field in refused.value.message_dict or "replicas" in refused.value.message_dict, (field, bad)


def test_a_topology_without_a_mode_is_a_preference(owner, environment):
    job = jobs.job_submit(actor=owner, data=job_data(environment, topology={"level": "node"}))
    assert job.spec["topology"] == {"level": "node", "mode": jobs.DEFAULT_TOPOLOGY_MODE}


# --- Per-flavor caps in the cycle ----------------------------------------------------------


def test_the_priority_cap_and_weight_are_the_flavors_own():
    from runners.scheduler.admission import FlavorQuota, TenantQuota
    from runners.scheduler.fairshare import weighted_dominant_share

    quota = TenantQuota("acme", {"h100": FlavorQuota(8, 16, weight=4.0, max_priority=5),
                                 "t4": FlavorQuota(0, 4, max_priority=900)}, weight=1.0, max_priority=900)
    assert quota.priority_cap({"h100": 2}) == 5
    assert quota.priority_cap({"t4": 1}) == 900
    # Half of the H100s at weight 4 weighs an eighth; half of the T4s at the tenant's weight 1, a half.
    capacity = {"h100": 16, "t4": 8}
    assert weighted_dominant_share({"h100": 8}, capacity, quota.weight, quota.flavor_weights()) == 0.125
    assert weighted_dominant_share({"t4": 4}, capacity, quota.weight, quota.flavor_weights()) == 0.5


def test_a_pass_finishes_every_job_whose_attempt_is_gone(owner, environment):
    """Attempts with no launch record on this host read as lost: each is finished and retried in one pass."""
    first, _ = _running(owner, environment, name="first", replicas=1)
    second, _ = _running(owner, environment, name="second", replicas=1)
    counts = reconcile.jobs_reconcile_run()
    assert counts["looked"] == 2 and counts["finished"] == 2
    for job in (first, second):
        job.refresh_from_db()
        assert job.state == "queued" and job.failures == 1
