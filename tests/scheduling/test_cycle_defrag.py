"""Moves that make room, in the scheduler cycle against the database (runners.scheduling.defrag).

The demo cluster's two H100 nodes have 8 GPUs each. The setup leaves on each a 4-GPU job and a 1-GPU
job (the two 1-GPU jobs forced onto different nodes by 7-GPU jobs that then end): 3 GPUs free on each
node, 6 in all, and a 4-GPU job fits on neither. Moving one 1-GPU job to the other node frees 4 GPUs
on one node. The launcher and the backend are played (tests.support.jobs), so each cycle's decision is
seen alone; the worker's end-to-end run, with real trainers resuming at their step, is
tests/jobs/test_job_moves.py.
"""

from datetime import timedelta

import pytest
from django.utils import timezone

from audit.models import AuditEntry
from runners.jobs import attempts
from runners.jobs.models import AttemptOutcome, Job, JobState
from runners.scheduling import services as scheduling
from runners.scheduling.models import JobMove
from tests.support.jobs import give_quota, play_launch, submit

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

ONE_NODE = {"level": "none", "mode": "required"}


def _placement(job):
    return job.attempts.order_by("-number").first().placement


def _gpus(job) -> set[tuple[str, int]]:
    return {(replica["node"], gpu) for replica in _placement(job) for gpu in replica["gpus"]}


def _run(actor, env, name, gpus, **overrides):
    """Submit a one-replica job, run a cycle, play its launch; the job, running."""
    job = submit(actor, env, name=name, replicas=1, gpus_per_replica=gpus, topology=ONE_NODE, **overrides)
    scheduling.cycle_run()
    job.refresh_from_db()
    assert job.state == "admitted", job.reason
    play_launch(job)
    job.refresh_from_db()
    return job


def _end(job, outcome=AttemptOutcome.SUCCEEDED, exit_code=0):
    attempt = job.attempts.get(ended_at__isnull=True)
    assert attempts.attempt_end(job.id, attempt.id, outcome=outcome, reason="test", exit_code=exit_code)
    job.refresh_from_db()


@pytest.fixture
def fragmented(flavors, tenant, other_tenant, owner, outsider, acme_env, globex_env):
    """Each H100 node: a 4-GPU job, a 1-GPU job (acme's small on one node, globex's on the other), 3 GPUs free."""
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=4, max=12)
    wide = [_run(owner, acme_env, f"wide-{n}", 7) for n in (1, 2)]
    small = {
        "acme": _run(owner, acme_env, "small", 1, steps=1000),
        "globex": _run(outsider, globex_env, "small", 1, steps=1000),
    }
    assert _placement(small["acme"])[0]["node"] != _placement(small["globex"])[0]["node"]
    for job in wide:
        _end(job)
    big = [_run(owner, acme_env, f"big-{n}", 4) for n in (1, 2)]
    assert _placement(big[0])[0]["node"] != _placement(big[1])[0]["node"]
    return small


def _gang(outsider, globex_env):
    return submit(outsider, globex_env, name="gang", replicas=1, gpus_per_replica=4, topology=ONE_NODE)


def test_a_job_that_fits_on_no_node_gets_room_by_one_move_and_both_are_placed_in_the_next_cycle(
    fragmented, outsider, globex_env, owner, acme_env, django_capture_on_commit_callbacks
):
    gang = _gang(outsider, globex_env)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        result = scheduling.cycle_run()
    gang.refresh_from_db()
    assert gang.state == "queued" and result["admitted"] == []
    moved = [job for job in Job.objects.filter(name="small") if job.state == JobState.PREEMPTED]
    assert len(moved) == 1, "one move is enough"
    mover = moved[0]
    assert result["preempted"] == [mover.id] and len(callbacks) == 1, "the stop is sent after commit"
    origin = _placement(mover)[0]["node"]
    assert mover.reason.startswith("Moved to make room: 4 whole H100-80GB GPUs free together on " + origin)
    assert "for job gang of tenant globex" in mover.reason and "resumes from that checkpoint" in mover.reason
    assert mover.stop_deadline is not None
    # Its new place and the gang's are kept: the gang's on the node the move clears, the mover's elsewhere.
    target = mover.pinned_placement
    assert target[0]["node"] != origin and len(target[0]["gpus"]) == 1
    assert {replica["node"] for replica in gang.pinned_placement} == {origin}
    assert len({gpu for replica in gang.pinned_placement for gpu in replica["gpus"]}) == 4
    assert (origin, _placement(mover)[0]["gpus"][0]) in {
        (replica["node"], gpu) for replica in gang.pinned_placement for gpu in replica["gpus"]}
    assert gang.reason.startswith("Waiting: it fitted on no node, so room is being made for it on " + origin)
    move = JobMove.objects.get()
    assert (move.job_id, move.for_job_id, move.from_node, move.to_node, move.units) == (
        mover.id, gang.id, origin, target[0]["node"], 1)
    entry = AuditEntry.objects.get(action="job.moved")
    assert entry.tenant_id == mover.tenant_id and entry.after["why"] == "moved to make room"
    assert entry.after["gain"].startswith("4 whole H100-80GB GPUs") and entry.after["for_job"] == "gang"
    assert AuditEntry.objects.get(action="job.room_made").tenant_id == gang.tenant_id

    # While the mover checkpoints, the kept places are taken for everyone else: a 1-GPU job lands on neither.
    other = submit(owner, acme_env, name="other", replicas=1, gpus_per_replica=1, topology=ONE_NODE)
    scheduling.cycle_run()
    other.refresh_from_db(), gang.refresh_from_db()
    assert other.state == "admitted" and gang.state == "queued" and gang.pinned_placement
    kept = {(r["node"], g) for job in (gang, mover) for r in job.pinned_placement for g in r["gpus"]}
    assert not _gpus(other) & kept

    # The mover stops as asked (checkpointed, 75): queued, and the next cycle admits both at their places.
    _end(mover, AttemptOutcome.PREEMPTED, 75)
    assert mover.state == "queued"
    result = scheduling.cycle_run()
    mover.refresh_from_db(), gang.refresh_from_db()
    assert set(result["admitted"]) == {mover.id, gang.id}
    assert _placement(mover) == target
    assert {replica["node"] for replica in _placement(gang)} == {origin}
    assert mover.pinned_placement is None and gang.pinned_placement is None


def test_a_tenant_that_turned_moves_off_keeps_its_jobs_where_they_are(fragmented, other_tenant, outsider, globex_env):
    other_tenant.allow_moves = False
    other_tenant.save()
    gang = _gang(outsider, globex_env)
    scheduling.cycle_run()
    mover = Job.objects.get(state=JobState.PREEMPTED)
    assert mover.tenant.slug == "acme", "only the tenant that allows moves has its job moved"
    assert fragmented["globex"].attempts.get().ended_at is None
    fragmented["globex"].refresh_from_db()
    assert fragmented["globex"].state == "running" and fragmented["globex"].pinned_placement is None
    gang.refresh_from_db()
    assert {replica["node"] for replica in gang.pinned_placement} == {_placement(mover)[0]["node"]}


def test_no_move_when_every_candidate_is_off_limits(fragmented, tenant, other_tenant, outsider, globex_env, settings):
    for owner_tenant in (tenant, other_tenant):
        owner_tenant.allow_moves = False
        owner_tenant.save()
    gang = _gang(outsider, globex_env)
    scheduling.cycle_run()
    gang.refresh_from_db()
    assert gang.state == "queued" and gang.pinned_placement is None and not JobMove.objects.exists()
    assert gang.reason.startswith("Waiting:") and "room" not in gang.reason
    assert not Job.objects.filter(state=JobState.PREEMPTED).exists()


def test_the_budget_and_the_window_hold_moves_back(fragmented, outsider, globex_env, settings):
    gang = _gang(outsider, globex_env)
    # Held: 4 + 4 + 1 + 1 GPUs; 0.0001 of their hour is 3.6 GPU-seconds, less than one move's 60.
    settings.DEFRAG_BUDGET = 0.0001
    scheduling.cycle_run()
    assert not JobMove.objects.exists()
    settings.DEFRAG_BUDGET = 0
    scheduling.cycle_run()
    assert not JobMove.objects.exists()
    # Within the budget, but both small jobs were moved within the window: neither moves again.
    settings.DEFRAG_BUDGET = 0.02
    # (Moves of another flavor, which teach nothing about what an H100 move costs.)
    for job in fragmented.values():
        JobMove.objects.create(job=job, flavor="elsewhere", from_node="x", to_node="y", units=1, cost_s=1, gain="test")
    scheduling.cycle_run()
    assert JobMove.objects.count() == 2 and not Job.objects.filter(state=JobState.PREEMPTED).exists()
    # Once the window is over, one moves.
    JobMove.objects.update(at=timezone.now() - timedelta(seconds=settings.DEFRAG_MOVE_WINDOW_S + 1))
    scheduling.cycle_run()
    assert JobMove.objects.count() == 3 and Job.objects.filter(state=JobState.PREEMPTED).count() == 1
    gang.refresh_from_db()
    assert gang.pinned_placement


def test_a_pin_that_ran_out_is_dropped_and_its_job_queues_as_any_other(fragmented, outsider, globex_env):
    gang = _gang(outsider, globex_env)
    scheduling.cycle_run()
    mover = Job.objects.get(state=JobState.PREEMPTED)
    Job.objects.filter(id__in=[gang.id, mover.id]).update(pinned_until=timezone.now() - timedelta(seconds=1))
    _end(mover, AttemptOutcome.PREEMPTED, 75)
    scheduling.cycle_run()
    gang.refresh_from_db(), mover.refresh_from_db()
    assert gang.pinned_placement is None
    # Both placed by the cycle as usual: the node the move cleared still has room for the gang.
    assert gang.state == mover.state == "admitted"
