"""Replica jobs and the other writers of Job rows: the promotion into the guarantee against the cycle's
preemption, the lock order of a scale-in against the cycle's admission, and the submit's rules for a
replica's job. Each race is forced into one interleaving from a second connection (a row held locked, the
other side seen waiting on it in pg_stat_activity); each docstring says what the code before the fix did.
"""

from __future__ import annotations

import threading

import pytest
from django.db import transaction

from audit.models import AuditEntry
from runners.inference import reconcile as endpoint_reconcile
from runners.inference import services as inference
from runners.inference.models import InferenceEndpoint
from runners.jobs.models import Job, JobState
from runners.scheduling import services as scheduling
from tests.support.endpoints import trained_job
from tests.support.jobs import give_quota, play_launch, submit
from tests.support.races import InThread, lock_waiters, rows_locked, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

ANYWHERE = {"level": "none", "mode": "preferred"}


def _endpoint(owner, environment, trained, **overrides) -> InferenceEndpoint:
    data = {"tenant": environment.tenant.slug, "environment": environment.id, "name": "chat",
            "source": {"job": trained.id}, "flavor": "h100-80gb", "gpus_per_replica": 1, "min_replicas": 0,
            "max_replicas": 1, "warm_replicas": 0}
    return inference.endpoint_deploy(actor=owner, data={**data, **overrides})


def test_a_replica_promoted_into_the_guarantee_while_the_cycle_picks_it_as_a_victim_is_not_preempted(
    tenant, other_tenant, owner, outsider, acme_env, globex_env, flavors
):
    """acme borrows all 16 H100s with a training job and an 8-GPU replica; globex's guaranteed job needs 8.

    Forced order: the cycle has read the replica as preemptible and chosen it as the victim, and waits
    for its row; meanwhile the endpoint's reconcile promotes it into acme's guarantee (min_replicas went
    to 1) and commits; then the cycle goes on. Before the fix the cycle preempted it anyway (nothing
    re-read `preemptible` under the row lock): a guaranteed replica stopped, and acme's guarantee held
    by nothing. Now the cycle leaves it, and its claimant waits for the next cycle to decide again.
    """
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    trained = trained_job(actor=owner, environment=acme_env)
    borrower = submit(owner, acme_env, name="borrower", replicas=1, gpus_per_replica=8, topology=ANYWHERE)
    endpoint = _endpoint(owner, acme_env, trained, gpus_per_replica=8)
    endpoint_reconcile.endpoint_reconcile(endpoint.id)
    replica = endpoint.replicas.get().job
    assert replica.preemptible
    scheduling.cycle_run()
    play_launch(borrower)
    play_launch(replica)  # started last, and priority 0: the first victim
    inference.endpoint_scale(actor=owner, endpoint=endpoint, data={"min_replicas": 1})
    owed = submit(outsider, globex_env, name="owed", replicas=1, gpus_per_replica=8, priority=50, topology=ANYWHERE)

    locked, go = threading.Event(), threading.Event()

    def promote():
        with transaction.atomic():
            list(Job.objects.select_for_update().filter(id=replica.id))
            locked.set()
            assert go.wait(30)
            endpoint_reconcile.endpoint_reconcile(endpoint.id)

    promoting = InThread(promote)
    assert locked.wait(10)
    the_cycle = InThread(scheduling.cycle_run)
    assert wait_until(lambda: lock_waiters() >= 1), "the cycle should wait for its victim's row"
    go.set()
    promoting.outcome()
    result = the_cycle.outcome()

    replica.refresh_from_db(), borrower.refresh_from_db(), owed.refresh_from_db()
    assert not replica.preemptible and replica.spec["preemptible"] is False
    assert replica.state == JobState.RUNNING, f"a guaranteed replica was preempted: {replica.reason}"
    assert result["preempted"] == [] and owed.state == JobState.QUEUED
    # The next cycle reads the replica inside the guarantee: it is no victim any more.
    assert replica.id not in scheduling.cycle_run()["preempted"]
    replica.refresh_from_db()
    assert replica.state == JobState.RUNNING and not replica.preemptible


def test_a_scale_in_and_the_cycle_admitting_the_same_replicas_lock_them_in_one_order(
    tenant, owner, acme_env, flavors
):
    """Two queued replicas, slot 0's job newer than slot 1's (it was replaced): the cycle admits both while a
    stop retires both.

    Forced order: slot 1's row (the older job) is held from outside; the reconcile (retiring) comes first,
    then the cycle; then the row is let go. Before the fix the reconcile locked the replicas by slot, highest
    first (the older job first here), and the cycle newest job first: each held one the other wanted, and
    PostgreSQL broke the deadlock by rolling one back (a whole cycle, or the stop). Now both lock in id
    order: the reconcile goes first, the cycle then finds both cancelled and admits neither.
    """
    from runners.jobs import services as jobs

    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    trained = trained_job(actor=owner, environment=acme_env)
    endpoint = _endpoint(owner, acme_env, trained, max_replicas=2, warm_replicas=1)
    endpoint_reconcile.endpoint_reconcile(endpoint.id)
    jobs.job_cancel(actor=owner, job=endpoint.replicas.get(slot=0).job)
    endpoint_reconcile.endpoint_reconcile(endpoint.id)  # slot 0 again, a newer job
    older = endpoint.replicas.get(slot=1).job
    newer = endpoint.replicas.exclude(job__state=JobState.CANCELLED).get(slot=0).job
    assert older.id < newer.id and older.state == newer.state == JobState.QUEUED
    inference.endpoint_stop(actor=owner, endpoint=endpoint)

    with rows_locked(Job.objects.filter(id=older.id)):
        stopping = InThread(endpoint_reconcile.endpoint_reconcile, endpoint_id=endpoint.id)
        assert wait_until(lambda: lock_waiters() >= 1), "the reconcile should wait for a replica's row"
        the_cycle = InThread(scheduling.cycle_run)
        assert wait_until(lambda: lock_waiters() >= 2), "the cycle should wait for a replica's row too"
    stopping.outcome()
    result = the_cycle.outcome()

    older.refresh_from_db(), newer.refresh_from_db()
    assert older.state == newer.state == JobState.CANCELLED
    assert result["admitted"] == []
    assert not older.attempts.exists() and not newer.attempts.exists()


def test_a_replicas_job_is_queued_by_the_submits_rules_and_recorded(tenant, owner, acme_env, flavors, settings):
    """Before the fix the reconcile wrote a replica's Job row itself: past JOB_QUEUED_MAX_PER_TENANT, without
    the tenant's lock and with no audit entry. Now it goes through the jobs app's own queueing."""
    settings.JOB_QUEUED_MAX_PER_TENANT = 1
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    trained = trained_job(actor=owner, environment=acme_env)
    waiting = submit(owner, acme_env, name="waiting", replicas=1, topology=ANYWHERE)
    endpoint = _endpoint(owner, acme_env, trained)

    endpoint_reconcile.endpoint_reconcile(endpoint.id)
    endpoint.refresh_from_db()
    assert not endpoint.replicas.exists(), "the tenant's queue is full: no replica job may be added"
    assert "JOB_QUEUED_MAX_PER_TENANT" in endpoint.reason

    from runners.jobs import services as jobs

    jobs.job_cancel(actor=owner, job=waiting)
    endpoint_reconcile.endpoint_reconcile(endpoint.id)
    replica = endpoint.replicas.get().job
    assert replica.state == JobState.QUEUED and replica.kind == Job.Kind.SERVING
    entry = AuditEntry.objects.get(action="job.submitted", object_id=str(replica.id))
    assert entry.tenant_id == tenant.id and entry.after["preemptible"] is True


def test_the_cycle_never_waits_on_a_row_to_explain_why_a_replica_waits(tenant, owner, acme_env, flavors):
    """Slot 0's replica waits (the guarantee is full, and it may not borrow); slot 1's, newer, is admitted by
    the cycle while a stop retires both.

    Forced order: slot 0's row is held from outside; the reconcile (retiring, in id order) waits on it; the
    cycle locks slot 1's row to admit it and writes the waiting one's reason; then the row is let go. Before
    the fix the cycle's write of reasons waited on slot 0's row behind the reconcile, which then wanted slot
    1's, held by the cycle: a deadlock, one of them rolled back. Now that write skips rows another
    transaction holds (the next cycle writes them), and both finish.
    """
    give_quota(tenant, flavors["h100-80gb"], guaranteed=1, max=4)
    trained = trained_job(actor=owner, environment=acme_env)
    holder_of_the_guarantee = submit(owner, acme_env, name="guaranteed", replicas=1, preemptible=False,
                                     topology=ANYWHERE)
    scheduling.cycle_run()
    play_launch(holder_of_the_guarantee)
    endpoint = _endpoint(owner, acme_env, trained, min_replicas=1, max_replicas=2, warm_replicas=1)
    endpoint_reconcile.endpoint_reconcile(endpoint.id)
    waiting, borrowing = endpoint.replicas.get(slot=0).job, endpoint.replicas.get(slot=1).job
    assert waiting.id < borrowing.id and not waiting.preemptible and borrowing.preemptible
    inference.endpoint_stop(actor=owner, endpoint=endpoint)

    with rows_locked(Job.objects.filter(id=waiting.id)):
        stopping = InThread(endpoint_reconcile.endpoint_reconcile, endpoint_id=endpoint.id)
        assert wait_until(lambda: lock_waiters() >= 1), "the reconcile should wait for slot 0's row"
        the_cycle = InThread(scheduling.cycle_run)
        # Before the fix the cycle waits here too; now it finishes on its own.
        wait_until(lambda: lock_waiters() >= 2 or not the_cycle.is_alive())
    stopping.outcome()
    result = the_cycle.outcome()

    assert result["admitted"] == [borrowing.id]
    waiting.refresh_from_db(), borrowing.refresh_from_db()
    assert waiting.state == borrowing.state == JobState.CANCELLED
    assert not waiting.attempts.exists() and borrowing.attempts.get().ended_at is not None
