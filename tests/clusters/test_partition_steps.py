"""A partition change advances one step per task run and re-enqueues itself: no worker waits for the cluster."""

import re

import pytest

from runners.clusters import services as clusters
from runners.clusters.models import Node, NodePool, PartitionChange, PartitionProfile
from runners.clusters.registry import get_backend
from tests.support.worker import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def h100_mig(db):
    return PartitionProfile.objects.create(
        name="h100-4g-3g", gpu_model="H100-80GB", kind="mig", layout=["4g.40gb", "3g.40gb"]
    )


def _change(staff, profile, **fields):
    return PartitionChange.objects.create(pool=NodePool.objects.get(name="h100-pool"), profile=profile, created_by=staff, **fields)


@pytest.mark.django_db
def test_each_run_does_one_step_and_hands_the_next_to_a_follow_up(inventory, h100_mig, staff, settings):
    settings.PARTITION_POLL_INTERVAL_S = 7
    change = _change(staff, h100_mig)
    backend = get_backend()

    state, delay, lease = clusters.partition_change_step(change_id=change.id)
    assert (state, delay) == ("relabeling", 0), "cordoned, found no work: relabel next, at once"
    assert not any(node.schedulable for node in Node.objects.filter(pool__name="h100-pool"))
    assert not backend.partition_applied("h100-node-1", clusters.partition_spec(h100_mig)), "nothing relabeled yet"

    # Between steps the change is leased to the follow-up: a redelivered copy without its lease does nothing.
    assert clusters.partition_change_step(change_id=change.id) == ("relabeling", None, None)
    assert clusters.partition_change_sweep(stuck_after_s=0) == [], "a change waiting for its follow-up is not stuck"

    state, delay, lease = clusters.partition_change_step(change_id=change.id, lease=lease)
    assert (state, delay) == ("waiting", 7), "relabeled; look again after the poll interval, not by sleeping"
    state, delay, lease = clusters.partition_change_step(change_id=change.id, lease=lease)
    assert (state, delay) == ("uncordoning", 0)
    state, delay, lease = clusters.partition_change_step(change_id=change.id, lease=lease)
    assert (state, delay, lease) == ("succeeded", None, None)
    assert all(node.schedulable for node in Node.objects.filter(pool__name="h100-pool"))


@pytest.mark.django_db
def test_a_node_that_never_reports_fails_the_change_after_the_timeout(inventory, h100_mig, staff, settings):
    from datetime import timedelta

    from django.utils import timezone

    settings.PARTITION_APPLY_TIMEOUT_S = 60
    long_ago = (timezone.now() - timedelta(seconds=61)).isoformat()
    # Relabel asked a minute ago, but the node never got it (so it cannot report the profile).
    change = _change(
        staff, h100_mig, state="waiting",
        steps=[{"at": long_ago, "node": "h100-node-1", "step": "relabeling", "message": "Asked h100-node-1."}],
    )
    state, delay, _lease = clusters.partition_change_step(change_id=change.id)
    assert (state, delay) == ("failed", None)
    change.refresh_from_db()
    assert "Timed out after 60s" in change.message and "h100-node-1" in change.message


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_a_real_worker_runs_the_change_through_its_re_enqueued_steps(celery_worker, client_for, staff, inventory, h100_mig):
    pool = NodePool.objects.get(name="h100-pool")
    response = client_for(staff).post(f"/api/v1/node-pools/{pool.id}/apply/", {"profile": "h100-4g-3g"})
    assert response.status_code == 202
    change_id = response.json()["id"]
    wait_for(lambda: PartitionChange.objects.get(id=change_id).state == "succeeded", message="the change to succeed")
    # Every step ran as its own task run, each reporting the state it left the change in.
    def states():
        # "Task runners.tasks.partition_apply[<id>] succeeded in 0.01s: 'waiting'", then the log's context.
        return [
            match.group(1)
            for line in celery_worker.output().splitlines()
            if "runners.tasks.partition_apply[" in line
            and (match := re.search(r" succeeded in [0-9.e-]+s: '([a-z_]+)'", line))
        ]

    expected = ["relabeling", "waiting", "uncordoning", "succeeded"]
    wait_for(lambda: states() == expected, timeout_s=10, message=f"one task run per step, {expected}; saw {states()}")
