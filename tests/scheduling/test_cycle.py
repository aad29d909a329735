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

pytestmark = pytest.mark.integration


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


# --- The cycle at scale: its launches, and its writes ----------------------------------------------


def _launches_on_the_broker() -> list[tuple[list, dict]]:
    """(args, headers) of every job_launch message waiting in this run's queue on the broker."""
    import base64
    import json

    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    found = []
    for key in client.keys(f"{settings.CELERY_TASK_DEFAULT_QUEUE}*"):
        if client.type(key) != b"list":
            continue
        for raw in client.lrange(key, 0, -1):
            message = json.loads(raw)
            headers = message.get("headers") or {}
            if headers.get("task") == "runners.tasks.job_launch":
                found.append((json.loads(base64.b64decode(message["body"]))[0], headers))
    return found


def _empty_the_queue() -> None:
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    client.delete(queue, *client.keys(f"{queue}*"))


@pytest.mark.django_db
def test_a_cycles_launches_all_reach_the_broker_in_one_batch_with_the_request_id(
    flavors, tenant, owner, acme_env, django_capture_on_commit_callbacks, monkeypatch
):
    import structlog
    from kombu.messaging import Producer

    from common import dispatch

    give_quota(tenant, flavors["h100-80gb"], guaranteed=16, max=16)
    submitted = [submit(owner, acme_env, name=f"one-{index}", replicas=1, gpus_per_replica=1) for index in range(12)]
    _empty_the_queue()
    batches, one_by_one = [], []
    real_batch, real_send_task = Producer.batch, dispatch.send_task
    monkeypatch.setattr(Producer, "batch", lambda self, *args, **kwargs: batches.append(1) or real_batch(self, *args, **kwargs))
    monkeypatch.setattr(dispatch, "send_task", lambda *args, **kwargs: one_by_one.append(args) or real_send_task(*args, **kwargs))
    structlog.contextvars.bind_contextvars(request_id="cycle-request-1")
    try:
        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            result = scheduling.cycle_run()
    finally:
        structlog.contextvars.unbind_contextvars("request_id")
    assert sorted(result["admitted"]) == sorted(job.id for job in submitted)
    assert len(callbacks) == 1, "one callback after commit sends every launch"
    sent = _launches_on_the_broker()
    assert sorted(args for args, _ in sent) == sorted([job.id, 1] for job in submitted), "one message per launch, as ever"
    assert all(headers.get("request_id") == "cycle-request-1" for _, headers in sent)
    assert len({headers["id"] for _, headers in sent}) == 12, "each message its own id (the launch's token)"
    assert batches == [1] and one_by_one == [], "through one publish batch, not one by one"
    for job in submitted:
        job.refresh_from_db()
        attempt = job.attempts.get()
        assert job.state == "admitted" and job.queue_position is None and attempt.number == 1
        assert attempt.admitted_at is not None and attempt.placement[0]["gpus"]
        assert [(event.from_state, event.to_state, event.reason) for event in job.events.all()][-1] == (
            "queued", "admitted", job.reason)


@pytest.mark.django_db
def test_when_the_batch_fails_every_launch_is_sent_one_by_one(
    flavors, tenant, owner, acme_env, django_capture_on_commit_callbacks, monkeypatch
):
    from kombu.transport import redis as kombu_redis

    give_quota(tenant, flavors["h100-80gb"], guaranteed=16, max=16)
    submitted = [submit(owner, acme_env, name=f"one-{index}", replicas=1, gpus_per_replica=1) for index in range(5)]
    _empty_the_queue()

    failed = []

    def fail(self):
        failed.append(self._buffered)
        raise ConnectionError("the broker went away mid-batch")

    monkeypatch.setattr(kombu_redis.PublishBatch, "flush", fail)
    with django_capture_on_commit_callbacks(execute=True):
        scheduling.cycle_run()
    assert failed == [5], "the batch of five was tried and failed"
    sent = sorted(args for args, _ in _launches_on_the_broker())
    assert sent == sorted([job.id, 1] for job in submitted), "each launch reached the broker once"


@pytest.mark.django_db
def test_the_cycles_own_write_leaves_a_job_that_left_the_queue_meanwhile(flavors, tenant, owner, acme_env):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=0, max=1)
    waiting = submit(owner, acme_env, name="waiting", replicas=1, gpus_per_replica=1)
    other = submit(owner, acme_env, name="other", replicas=1, gpus_per_replica=1)
    stale = list(Job.objects.filter(id__in=[waiting.id, other.id]).order_by("id"))  # what a cycle snapshotted
    jobs.job_cancel(actor=owner, job=waiting)
    for position, job in enumerate(stale, start=1):
        job.reason, job.queue_position = "Waiting: something.", position
    jobs.job_rows_update(stale, ["reason", "queue_position", "projected_start"], only_in_state=JobState.QUEUED)
    waiting.refresh_from_db(), other.refresh_from_db()
    assert waiting.state == "cancelled" and waiting.reason.startswith("Cancelled by") and waiting.queue_position is None
    assert other.reason == "Waiting: something." and other.queue_position == 2


@pytest.mark.django_db
def test_the_cycle_scores_placements_against_the_flavors_latest_submissions(flavors, tenant, owner, acme_env):
    flavor = flavors["h100-80gb"]
    give_quota(tenant, flavor, guaranteed=16, max=16)
    nodes = scheduling._inventory()
    snapshot, _, share = scheduling._snapshot_for(flavor, nodes, scheduling._usage([], {}), {})
    # Nothing submitted yet: the prior alone, one whole GPU with a node's share of CPU and memory.
    prior = scheduling._recent_typical(flavor, share, snapshot)
    assert [(t.num_gpu, t.gpu_milli, t.frequency) for t in prior] == [(1, 1000, 1.0)]
    for index in range(30):
        submit(owner, acme_env, name=f"eight-{index}", replicas=2, gpus_per_replica=8,
               topology={"level": "none", "mode": "preferred"})
    submit(owner, acme_env, name="one", replicas=1, gpus_per_replica=1)
    learnt = {(t.num_gpu, t.cpu_milli): t.frequency for t in scheduling._recent_typical(flavor, share, snapshot)}
    # 60 replicas of 8 GPUs against the prior's 32 pods' worth: the 8-GPU shape leads.
    eight = next(frequency for (gpus, _), frequency in learnt.items() if gpus == 8)
    assert eight > 0.6 and max(learnt.values()) == eight
    # A MIG flavor is not scored by FGD: no mix.
    mig = next(f for f in flavors.values() if f.kind == "mig")
    mig_snapshot, _, mig_share = scheduling._snapshot_for(mig, nodes, scheduling._usage([], {}), {})
    assert scheduling._recent_typical(mig, mig_share, mig_snapshot) is None
