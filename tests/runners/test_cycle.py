"""The scheduler cycle against the database: admission by quota and fair share, placement on free GPUs,
preemption, and one cycle at a time."""

import threading

import pytest
from django.db import connection

from runners.jobs import services as jobs
from runners.jobs.models import Job, JobState
from runners.scheduling import services as scheduling
from runners.scheduling.models import SchedulerCycle
from tests.support.jobs import give_quota, play_launch, submit


def _placed(job):
    return job.attempts.order_by("-number").first().placement


@pytest.mark.django_db
def test_a_job_within_quota_is_admitted_as_one_gang_on_one_node(flavors, tenant, owner, acme_env, django_capture_on_commit_callbacks):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=8)
    job = submit(owner, acme_env, replicas=2, gpus_per_replica=2)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        result = scheduling.cycle_run()
    assert result["admitted"] == [job.id]
    job.refresh_from_db()
    assert job.state == "admitted" and job.reason.startswith("Admitted and placed on h100-node-")
    placement = _placed(job)
    assert [replica["replica"] for replica in placement] == [0, 1]
    assert len({replica["node"] for replica in placement}) == 1, "topology node, required"
    gpus = [gpu for replica in placement for gpu in replica["gpus"]]
    assert len(gpus) == 4 and len(set(gpus)) == 4
    assert len(callbacks) == 1, "the launch is sent after commit"
    assert [event.to_state for event in job.events.all()] == ["queued", "admitted"]


@pytest.mark.django_db
def test_past_max_a_job_waits_with_the_reason_and_its_place_in_line(flavors, tenant, owner, acme_env):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=8)
    first = submit(owner, acme_env, name="first", replicas=2, gpus_per_replica=4)
    second = submit(owner, acme_env, name="second", replicas=2, gpus_per_replica=4)
    scheduling.cycle_run()
    first.refresh_from_db(), second.refresh_from_db()
    assert first.state == "admitted"
    assert second.state == "queued" and second.queue_position == 1
    assert "max" in second.reason, second.reason


@pytest.mark.django_db
def test_placement_takes_out_what_running_attempts_hold(flavors, tenant, owner, acme_env):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=16, max=16)
    first = submit(owner, acme_env, name="first", replicas=1, gpus_per_replica=8)
    scheduling.cycle_run()
    play_launch(first)
    second = submit(owner, acme_env, name="second", replicas=1, gpus_per_replica=8)
    scheduling.cycle_run()
    assert {_placed(first)[0]["node"], _placed(second)[0]["node"]} == {"h100-node-1", "h100-node-2"}
    third = submit(owner, acme_env, name="third", replicas=1, gpus_per_replica=1)
    scheduling.cycle_run()
    third.refresh_from_db()
    assert third.state == "queued", "all 16 H100s are held"


@pytest.mark.django_db
def test_a_guarantee_reclaims_borrowed_gpus_by_preempting_with_a_deadline(
    flavors, tenant, other_tenant, owner, outsider, acme_env, globex_env, settings, django_capture_on_commit_callbacks
):
    settings.PREEMPTION_GRACE_PERIOD_S = 30
    give_quota(tenant, flavors["h100-80gb"], guaranteed=0, max=16)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    borrower = submit(owner, acme_env, name="borrower", replicas=2, gpus_per_replica=8, topology={"level": "none", "mode": "preferred"})
    scheduling.cycle_run()
    play_launch(borrower)
    owed = submit(outsider, globex_env, name="owed", replicas=1, gpus_per_replica=8, priority=50)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        result = scheduling.cycle_run()
    borrower.refresh_from_db(), owed.refresh_from_db()
    assert result["preempted"] == [borrower.id]
    assert borrower.state == "preempted" and borrower.reason == (
        "Preempted for job owed of tenant globex: tenant acme is borrowing h100-80gb beyond its guarantee and "
        "tenant globex needs its guarantee back. It was asked to checkpoint and stop within 30 seconds; then it "
        "waits in the queue and resumes from its newest checkpoint."
    )
    assert borrower.stop_deadline is not None
    assert owed.state == "queued", "it starts once the victim has stopped"
    assert len(callbacks) == 1, "the stop is sent after commit"
    # The victim still holds its GPUs until it stops: another cycle preempts nothing more.
    assert scheduling.cycle_run()["preempted"] == []


@pytest.mark.django_db
def test_mig_and_time_slice_jobs_take_existing_slices(flavors, tenant, owner, acme_env):
    shared = next(name for name in flavors if name.startswith("t4") and name.endswith("shared"))
    give_quota(tenant, flavors["a100-40gb-mig-1g.5gb"], guaranteed=8, max=8)
    give_quota(tenant, flavors[shared], guaranteed=8, max=8)
    mig_job = submit(owner, acme_env, name="mig", flavor="a100-40gb-mig-1g.5gb", replicas=8,
                      topology={"level": "none", "mode": "required"})
    ts_job = submit(owner, acme_env, name="ts", flavor=shared, replicas=5, topology={"level": "node", "mode": "preferred"})
    scheduling.cycle_run()
    mig_job.refresh_from_db(), ts_job.refresh_from_db()
    assert mig_job.state == ts_job.state == "admitted", (mig_job.reason, ts_job.reason)
    slices = {(r["node"], r["gpus"][0], r["mig_start"]) for r in _placed(mig_job)}
    assert len(slices) == 8 and all(r["mig_profile"] == "1g.5gb" for r in _placed(mig_job))
    assert {start for _, _, start in slices} <= {2, 3}, "the demo layout's 1g.5gb instances start at 2 and 3"
    assert len(_placed(ts_job)) == 5


@pytest.mark.django_db(transaction=True)
def test_two_cycles_at_once_never_admit_the_same_capacity_twice(flavors, tenant, owner, acme_env):
    assert connection.vendor == "postgresql"
    give_quota(tenant, flavors["h100-80gb"], guaranteed=16, max=64)
    for index in range(6):
        submit(owner, acme_env, name=f"job-{index}", replicas=1, gpus_per_replica=8)
    barrier = threading.Barrier(2)
    results, errors = [], []

    def run():
        try:
            barrier.wait()
            results.append(scheduling.cycle_run())
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    admitted = [job_id for result in results for job_id in result["admitted"]]
    assert len(admitted) == 2 == len(set(admitted)), "16 H100s hold two 8-GPU jobs, once each"
    assert Job.objects.filter(state="admitted").count() == 2
    assert SchedulerCycle.objects.get().runs == 2


@pytest.mark.django_db
def test_the_cycle_does_not_overwrite_the_reason_of_a_job_that_left_the_queue_meanwhile(flavors, tenant, owner, acme_env):
    from runners.jobs.services import job_rows_update

    give_quota(tenant, flavors["h100-80gb"], guaranteed=0, max=1)
    waiting = submit(owner, acme_env, name="waiting", replicas=1, gpus_per_replica=1)
    stale = Job.objects.get(id=waiting.id)  # what a cycle snapshotted
    jobs.job_cancel(actor=owner, job=waiting)
    stale.reason, stale.queue_position = "waiting: something", 3
    job_rows_update([stale], ["reason", "queue_position"], only_in_state=JobState.QUEUED)
    waiting.refresh_from_db()
    assert waiting.state == "cancelled" and waiting.reason.startswith("Cancelled by")
    assert waiting.queue_position is None
