"""Applying a partition profile to a node pool, on the local backend."""

import json

import pytest

from quotas.models import ResourceFlavor
from runners.clusters import services as clusters
from runners.clusters.models import Gpu, Node, NodePool, PartitionChange, PartitionProfile
from runners.clusters.registry import get_backend
from tests.support.partitions import drive_partition_change

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def h100_mig(db):
    return PartitionProfile.objects.create(
        name="h100-4g-3g", gpu_model="H100-80GB", kind="mig", layout=["4g.40gb", "3g.40gb"]
    )


def test_inventory_sync_loads_the_demo_cluster(inventory):
    assert inventory == {"nodes": 5, "pools": 3, "removed": 0}
    node = Node.objects.get(name="a100-node-1")
    assert (node.rack, node.block, node.pool.name) == ("rack-b", "block-b1", "a100-pool")
    assert node.gpu_resources == {"nvidia.com/mig-3g.20gb": 4, "nvidia.com/mig-2g.10gb": 4, "nvidia.com/mig-1g.5gb": 8}
    assert Gpu.objects.filter(node__pool__name="h100-pool").count() == 16
    assert NodePool.objects.get(name="t4-pool").gpu_model == "T4"


def _apply(client, pool, captured, **payload):
    """POST apply, then run the task it enqueued after commit, as a worker would."""
    with captured() as callbacks:
        response = client.post(f"/api/v1/node-pools/{pool.id}/apply/", payload)
    assert response.status_code == 202, response.content
    assert len(callbacks) == 1
    drive_partition_change(response.json()["id"])
    return PartitionChange.objects.get(id=response.json()["id"])


def test_applying_a_mig_profile_rewrites_the_local_inventory(client_for, staff, inventory, h100_mig, django_capture_on_commit_callbacks):
    pool = NodePool.objects.get(name="h100-pool")
    change = _apply(client_for(staff), pool, django_capture_on_commit_callbacks, profile="h100-4g-3g")
    assert change.state == "succeeded", change.message
    steps = [(step["step"], step["node"]) for step in change.steps]
    assert steps[:2] == [("cordoning", "h100-node-1"), ("cordoning", "h100-node-2")]
    assert steps[-3:-1] == [("uncordoning", "h100-node-1"), ("uncordoning", "h100-node-2")]
    node = Node.objects.get(name="h100-node-1")
    assert node.gpu_resources == {"nvidia.com/mig-4g.40gb": 8, "nvidia.com/mig-3g.40gb": 8}
    assert node.schedulable
    assert Gpu.objects.get(node=node, index=0).mig_layout == [["4g.40gb", 0], ["3g.40gb", 4]]
    pool.refresh_from_db()
    assert pool.partition_profile == h100_mig
    shown = client_for(staff).get(f"/api/v1/node-pools/{pool.id}/").json()
    assert shown["partition_profile"] == "h100-4g-3g" and shown["latest_change"]["state"] == "succeeded"


def test_a_profile_for_another_model_is_refused(client_for, staff, inventory, h100_mig):
    pool = NodePool.objects.get(name="t4-pool")
    response = client_for(staff).post(f"/api/v1/node-pools/{pool.id}/apply/", {"profile": "h100-4g-3g"})
    assert response.status_code == 400
    assert "is for H100-80GB" in response.json()["profile"][0]
    assert not PartitionChange.objects.exists()


def test_with_work_running_and_drain_wait_it_refuses(client_for, staff, inventory, h100_mig):
    backend = get_backend()
    with backend._state(write=True) as state:  # what a running local job registers
        state["workloads"]["h100-node-2"] = ["acme-train/job-7"]
    pool = NodePool.objects.get(name="h100-pool")
    response = client_for(staff).post(f"/api/v1/node-pools/{pool.id}/apply/", {"profile": "h100-4g-3g", "drain": "wait"})
    assert response.status_code == 400
    message = response.json()["drain"][0]
    assert "Work is running on pool h100-pool (h100-node-2: acme-train/job-7)" in message
    assert "drain=preempt" in message
    assert not PartitionChange.objects.exists()
    assert Node.objects.get(name="h100-node-1").gpu_resources == {"nvidia.com/gpu": 8}


def test_with_drain_preempt_the_work_is_evicted_first(client_for, staff, inventory, h100_mig, django_capture_on_commit_callbacks):
    backend = get_backend()
    with backend._state(write=True) as state:
        state["workloads"]["h100-node-2"] = ["acme-train/job-7"]
    pool = NodePool.objects.get(name="h100-pool")
    change = _apply(client_for(staff), pool, django_capture_on_commit_callbacks, profile="h100-4g-3g", drain="preempt")
    assert change.state == "succeeded", change.message
    assert ("draining", "h100-node-2") in [(s["step"], s["node"]) for s in change.steps]
    assert backend.node_workloads("h100-node-2") == []


def test_work_that_starts_after_the_request_is_caught_after_cordoning(inventory, h100_mig, staff):
    pool = NodePool.objects.get(name="h100-pool")
    change = PartitionChange.objects.create(pool=pool, profile=h100_mig, drain="wait", created_by=staff)
    with get_backend()._state(write=True) as state:
        state["workloads"]["h100-node-1"] = ["acme-train/late-job"]
    assert drive_partition_change(change.id) == "refused"
    change.refresh_from_db()
    assert "late-job" in change.message
    assert all(node.schedulable for node in Node.objects.all()), "a refused change uncordons what it cordoned"
    state = json.loads(get_backend().state_file.read_text())
    assert "partition" not in state["nodes"].get("h100-node-1", {})


def test_a_second_change_while_one_is_in_flight_is_refused(client_for, staff, inventory, h100_mig):
    pool = NodePool.objects.get(name="h100-pool")
    PartitionChange.objects.create(pool=pool, profile=h100_mig, drain="wait", created_by=staff)
    response = client_for(staff).post(f"/api/v1/node-pools/{pool.id}/apply/", {"profile": "h100-4g-3g"})
    assert response.status_code == 400
    assert "already being re-partitioned" in response.json()["profile"][0]


def test_bad_apply_input_gets_400_naming_the_field(client_for, staff, inventory, h100_mig):
    pool = NodePool.objects.get(name="h100-pool")
    client = client_for(staff)
    assert "profile" in client.post(f"/api/v1/node-pools/{pool.id}/apply/", {"profile": "nope"}).json()
    assert "drain" in client.post(f"/api/v1/node-pools/{pool.id}/apply/", {"profile": "h100-4g-3g", "drain": "now"}).json()
    assert not PartitionChange.objects.exists()


def test_the_inventory_is_staffs_and_tenants_see_capacity_per_flavor(client_for, owner, staff, inventory, h100_mig):
    """Pools and nodes are the operator's view: a tenant lists none and gets 404 for one; flavors show capacity."""
    client = client_for(owner)
    assert client_for(staff).get("/api/v1/nodes/").json()["count"] == 5
    assert client.get("/api/v1/nodes/").json()["count"] == 0
    assert client.get("/api/v1/node-pools/").json()["count"] == 0
    node = Node.objects.get(name="h100-node-1")
    assert client.get(f"/api/v1/nodes/{node.id}/").status_code == 404
    pool = NodePool.objects.get(name="h100-pool")
    assert client.get(f"/api/v1/node-pools/{pool.id}/").status_code == 404
    assert client.post(f"/api/v1/node-pools/{pool.id}/apply/", {"profile": "h100-4g-3g"}).status_code == 403
    ResourceFlavor.objects.create(name="h100-80gb", kind="whole", gpu_model="H100-80GB")
    flavors = {flavor["name"]: flavor for flavor in client.get("/api/v1/flavors/").json()["results"]}
    assert flavors["h100-80gb"]["capacity"] == 16


def test_tenants_never_see_partition_changes_which_name_other_tenants_work(client_for, owner, staff, inventory, h100_mig):
    pool = NodePool.objects.get(name="h100-pool")
    change = PartitionChange.objects.create(
        pool=pool, profile=h100_mig, drain="wait", state="refused", message="Refused: work is running (h100-node-1: globex-secret/job-1)"
    )
    client = client_for(owner)
    assert client.get("/api/v1/partition-changes/").json()["results"] == []
    assert client.get(f"/api/v1/partition-changes/{change.id}/").status_code == 404
    assert client.get(f"/api/v1/node-pools/{pool.id}/").status_code == 404
    assert client_for(staff).get(f"/api/v1/partition-changes/{change.id}/").json()["message"].startswith("Refused")


def test_a_redelivered_copy_leaves_a_change_with_a_live_lease_alone(inventory, h100_mig, staff):
    from datetime import timedelta

    from django.utils import timezone

    pool = NodePool.objects.get(name="h100-pool")
    change = PartitionChange.objects.create(
        pool=pool, profile=h100_mig, drain="wait", created_by=staff, state="waiting",
        lease_expires_at=timezone.now() + timedelta(seconds=60),
    )
    assert drive_partition_change(change.id) == "waiting"
    state_file = get_backend().state_file
    assert not state_file.exists() or json.loads(state_file.read_text())["nodes"] == {}, "no node was touched"
    assert clusters.partition_change_sweep(stuck_after_s=120) == [], "a live lease is not stuck"


def test_a_change_whose_worker_died_is_swept_and_resumed(inventory, h100_mig, staff, django_capture_on_commit_callbacks):
    from datetime import timedelta

    from django.utils import timezone

    pool = NodePool.objects.get(name="h100-pool")
    change = PartitionChange.objects.create(
        pool=pool, profile=h100_mig, drain="wait", created_by=staff, state="relabeling",
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )
    assert clusters.partition_change_sweep(stuck_after_s=120) == [change.id]
    assert drive_partition_change(change.id) == "succeeded"
    assert Node.objects.get(name="h100-node-2").gpu_resources == {"nvidia.com/mig-4g.40gb": 8, "nvidia.com/mig-3g.40gb": 8}


def test_giving_up_before_the_relabel_hands_the_nodes_back(inventory, h100_mig, staff):
    pool = NodePool.objects.get(name="h100-pool")
    change = PartitionChange.objects.create(pool=pool, profile=h100_mig, drain="preempt", created_by=staff, state="draining")
    for name in ("h100-node-1", "h100-node-2"):
        get_backend().cordon(name)
    clusters.partition_change_give_up(change_id=change.id, reason="eviction kept answering 429")
    change.refresh_from_db()
    assert change.state == "failed" and "429" in change.message
    assert all(node.schedulable for node in get_backend().discover_inventory() if node.pool == "h100-pool")


def test_a_node_an_operator_had_cordoned_stays_cordoned(inventory, h100_mig, staff):
    from runners.clusters.services import inventory_sync

    get_backend().cordon("h100-node-2")
    inventory_sync()
    pool = NodePool.objects.get(name="h100-pool")
    change = PartitionChange.objects.create(pool=pool, profile=h100_mig, drain="wait", created_by=staff)
    assert drive_partition_change(change.id) == "succeeded"
    assert Node.objects.get(name="h100-node-1").schedulable
    assert not Node.objects.get(name="h100-node-2").schedulable
