"""A partition change's cordon and a scheduler cycle in flight, forced into the one interleaving that matters.

The cycle reads the schedulable inventory, decides and places, then commits; the change's first step
cordons the pool's nodes, then asks what is placed there. Here the cycle is held between its placement
and its commit (the job it admits is locked from another connection, so its commit waits on that row)
while the cordon step runs, then both are let go.
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import transaction

from runners.clusters import services as clusters
from runners.clusters.models import Node, NodePool, PartitionChange, PartitionProfile
from runners.jobs.models import Job, JobState
from runners.scheduling import services as scheduling
from tests.support.jobs import give_quota, ready_environment, submit
from tests.support.races import InThread, lock_waiters, rows_locked, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

ONE_GPU = {"replicas": 1, "gpus_per_replica": 1, "topology": {"level": "none", "mode": "preferred"}}


@pytest.fixture
def borrowing_env(flavors, tenant, owner):
    """acme on H100 with no guarantee, so re-cutting the pool strands none."""
    give_quota(tenant, flavors["h100-80gb"], guaranteed=0, max=16)
    return ready_environment(actor=owner, tenant=tenant)


def test_a_cycle_committing_while_the_pool_is_cordoned_is_seen_by_the_cordon_step(owner, staff, borrowing_env):
    """The cycle has placed a job on the H100 pool and is about to commit; the change's cordon step runs now.

    Before the fix the cordon marked the nodes unschedulable and asked what was placed on them while the
    cycle's attempt was not committed yet: it found nothing, went on to relabel, and the cycle then
    committed the job onto a node being re-cut (the change ended succeeded with the job admitted there).
    Now the cycle re-reads the nodes it placed on under their row locks before it commits, and the cordon
    writes those rows before it asks: so the cordon waits for the cycle, sees its job and refuses.
    """
    pool = NodePool.objects.get(name="h100-pool")
    profile = PartitionProfile.objects.create(name="h100-4g-3g", gpu_model="H100-80GB", kind="mig",
                                              layout=["4g.40gb", "3g.40gb"])
    change = PartitionChange.objects.create(pool=pool, profile=profile, drain=PartitionChange.Drain.WAIT,
                                            created_by=staff)
    job = submit(owner, borrowing_env, **ONE_GPU)

    with rows_locked(Job.objects.filter(id=job.id)):
        cycle = InThread(scheduling.cycle_run)
        assert wait_until(lambda: lock_waiters() >= 1), "the cycle never reached its commit"
        cordon = InThread(clusters.partition_change_step, change_id=change.id)
        # The cordon either finishes (nothing holds it) or waits on a lock the cycle holds.
        assert wait_until(lambda: not cordon.is_alive() or lock_waiters() >= 2)
    assert cycle.outcome()["admitted"] == [job.id]
    state, delay_s, lease = cordon.outcome()
    while delay_s is not None:  # the steps that follow, as the task's re-enqueued runs would take them
        time.sleep(delay_s)
        state, delay_s, lease = clusters.partition_change_step(change_id=change.id, lease=lease)

    job.refresh_from_db()
    assert job.state == JobState.ADMITTED
    node = job.attempts.get(ended_at__isnull=True).placement[0]["node"]
    assert Node.objects.get(name=node).pool_id == pool.id
    change.refresh_from_db()
    assert state == change.state == PartitionChange.State.REFUSED, change.message
    assert f"job-{job.id}" in change.message
    # The old partition is still in place and handed back: the job keeps what it was placed on.
    assert all(Node.objects.filter(pool=pool).values_list("schedulable", flat=True))
    assert Node.objects.get(name=node).gpu_resources == {"nvidia.com/gpu": 8}




def test_a_cordon_under_way_when_the_cycle_comes_to_commit_leaves_the_job_queued(owner, borrowing_env):
    """A cordon has the pool's node rows (locked, about to mark them unschedulable) when the cycle, having
    placed a job there on the inventory it read at its start, comes to commit.

    Before the fix the cycle did not look at the nodes again: it committed the job onto the pool's nodes
    while they were being cordoned. Now it re-reads them under their row locks, so it waits for the
    cordon, finds them cordoned and leaves the job queued, saying why.
    """
    pool = NodePool.objects.get(name="h100-pool")
    names = list(pool.nodes.order_by("id").values_list("name", flat=True))
    job = submit(owner, borrowing_env, **ONE_GPU)  # H100: only h100-pool has them
    locked, go = threading.Event(), threading.Event()

    def cordon():
        with transaction.atomic():
            list(Node.objects.select_for_update().filter(name__in=names).order_by("id"))
            locked.set()
            go.wait(60)
            clusters._set_schedulable(names, False)  # what the cordon step writes, in the transaction that locked

    holder = InThread(cordon)
    assert locked.wait(10), "could not lock the nodes"
    cycle = InThread(scheduling.cycle_run)
    wait_until(lambda: not cycle.is_alive() or lock_waiters() >= 1)
    go.set()
    holder.outcome()
    result = cycle.outcome()

    job.refresh_from_db()
    placed_on = {replica["node"] for attempt in job.attempts.all() for replica in attempt.placement}
    assert not placed_on & set(names), f"job {job.id} was admitted onto {sorted(placed_on)}, being cordoned"
    assert job.id not in result["admitted"]
    assert job.state == JobState.QUEUED and "cordoned" in job.reason, job.reason
