"""Launch and reconcile through the services the tasks call, with the real local backend and real processes."""


import pytest
from django.utils import timezone

from runners.jobs import attempts as job_attempts
from runners.jobs import reconcile
from runners.jobs import services as jobs
from runners.jobs.models import Job, JobState
from runners.scheduling import services as scheduling
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment, reconcile_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]


@pytest.fixture
def environment(tenant, owner):
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16)
    return ready_environment(actor=owner, tenant=tenant)


def _admitted(owner, environment, **overrides):
    job = jobs.job_submit(actor=owner, data=job_data(environment, **overrides))
    scheduling.cycle_run()
    job.refresh_from_db()
    assert job.state == "admitted", job.reason
    return job


def test_a_replica_that_fails_is_retried_then_the_job_fails_with_the_reason(owner, environment):
    # The largest batch the spec allows, in the least memory it allows: the replica cannot allocate
    # its first step within its memory limit and exits 1.
    job = _admitted(owner, environment, replicas=1, max_retries=1, memory_mib_per_replica=512,
                    hyperparameters={"batch_size": 1024, "seq_len": 512},
                    topology={"level": "none", "mode": "required"})
    assert job_attempts.job_launch_run(job_id=job.id, attempt_number=1) == "running"
    job = reconcile_until(job, {"failed"})
    attempts = list(job.attempts.order_by("number"))
    assert [(a.outcome, a.exit_code) for a in attempts] == [("failed", 1), ("failed", 1)]
    assert job.failures == 2
    assert "Replica 0 exited with 1" in job.reason and "max_retries is 1" in job.reason
    events = [event.to_state for event in job.events.all()]
    assert events.count("queued") == 2, "queued at submit, requeued once for the retry"


def test_a_job_cancelled_before_its_launch_went_through_ends_cancelled(owner, environment):
    job = _admitted(owner, environment, replicas=1, topology={"level": "none", "mode": "required"})
    assert jobs.transition(job, JobState.LAUNCHING, "a worker took the launch")
    jobs.job_cancel(actor=owner, job=job)
    job.refresh_from_db()
    assert job.state == "cancelling"
    # The launch message, redelivered now, sees the cancel and starts nothing.
    assert job_attempts.job_launch_run(job_id=job.id, attempt_number=1) == "cancelling"
    assert job.attempts.get().started_at is None
    Job.objects.filter(id=job.id).update(state_changed_at=timezone.now() - timezone.timedelta(minutes=5))
    reconcile.jobs_reconcile_run()
    job.refresh_from_db()
    assert job.state == "cancelled"
    assert job.attempts.get().outcome == "cancelled"
