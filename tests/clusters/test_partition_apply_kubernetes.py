"""Applying a partition profile to a node pool on Kubernetes (the API server stand-in)."""

import pytest

from runners.clusters import services as clusters
from runners.clusters.models import Node, NodePool, PartitionChange, PartitionProfile
from tests.support.k8s import gpu_node, portal_pod
from tests.support.partitions import drive_partition_change

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]


@pytest.fixture
def cluster(kubernetes_cluster):
    api = kubernetes_cluster
    for namespace in ("gpu-operator", "acme-train"):
        api.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    api.put(gpu_node("gpu-1"))
    api.put(gpu_node("gpu-2"))
    clusters.inventory_sync()
    return api


@pytest.fixture
def profile(db):
    return PartitionProfile.objects.create(name="h100-4g-3g", gpu_model="H100-80GB", kind="mig", layout=["4g.40gb", "3g.40gb"])


def test_inventory_sync_reads_the_nodes(cluster):
    pool = NodePool.objects.get(name="h100-pool")
    assert pool.gpu_model == "H100-80GB"
    assert sorted(pool.nodes.values_list("name", flat=True)) == ["gpu-1", "gpu-2"]
    assert Node.objects.get(name="gpu-1").gpu_resources == {"nvidia.com/gpu": 8}


def test_nodes_are_cordoned_labelled_waited_on_and_uncordoned_in_that_order(client_for, staff, cluster, profile, django_capture_on_commit_callbacks):
    pool = NodePool.objects.get(name="h100-pool")
    with django_capture_on_commit_callbacks():
        response = client_for(staff).post(f"/api/v1/node-pools/{pool.id}/apply/", {"profile": "h100-4g-3g"})
    assert response.status_code == 202, response.content
    cluster.clear_log()
    assert drive_partition_change(response.json()["id"]) == "succeeded"

    writes = [(r.method, r.path, r.content_type) for r in cluster.requests if r.method != "GET"]
    node_patches = [path.rsplit("/", 1)[1] for method, path, _ in writes if "/nodes/" in path]
    # gpu-1 and gpu-2: cordon both, relabel both, then (after waiting) uncordon both.
    assert node_patches == ["gpu-1", "gpu-2", "gpu-1", "gpu-2", "gpu-1", "gpu-2"]
    node_patch_positions = [i for i, r in enumerate(cluster.requests) if r.method == "PATCH" and "/nodes/" in r.path]
    last_relabel, first_uncordon = node_patch_positions[3], node_patch_positions[4]
    waits = [r for r in cluster.requests[last_relabel:first_uncordon] if r.method == "GET" and "/nodes/" in r.path]
    assert waits, "it read the nodes until they reported the new layout before handing them back"
    steps = [step["step"] for step in PartitionChange.objects.get().steps]
    first = {name: steps.index(name) for name in ("cordoning", "relabeling", "waiting", "uncordoning")}
    assert first["cordoning"] < first["relabeling"] < first["waiting"] < first["uncordoning"]
    for name in ("gpu-1", "gpu-2"):
        node = cluster.get("nodes", name)
        assert "unschedulable" not in node["spec"]
        assert node["metadata"]["labels"]["nvidia.com/mig.config"] == "h100-4g-3g"
        assert node["metadata"]["labels"]["nvidia.com/mig.config.state"] == "success"
    assert Node.objects.get(name="gpu-1").gpu_resources == {"nvidia.com/mig-3g.40gb": 8, "nvidia.com/mig-4g.40gb": 8}


def test_with_a_pod_running_and_drain_wait_it_refuses(client_for, staff, cluster, profile):
    cluster.put(portal_pod("job-7", "gpu-2"))
    pool = NodePool.objects.get(name="h100-pool")
    response = client_for(staff).post(f"/api/v1/node-pools/{pool.id}/apply/", {"profile": "h100-4g-3g", "drain": "wait"})
    assert response.status_code == 400
    assert "gpu-2: acme-train/job-7" in response.json()["drain"][0]
    assert not PartitionChange.objects.exists()
    assert not any(r.method == "PATCH" for r in cluster.requests), "no node was touched"


def test_with_drain_preempt_the_pod_is_evicted_before_relabelling(client_for, staff, cluster, profile, django_capture_on_commit_callbacks):
    cluster.put(portal_pod("job-7", "gpu-2"))
    pool = NodePool.objects.get(name="h100-pool")
    with django_capture_on_commit_callbacks():
        response = client_for(staff).post(f"/api/v1/node-pools/{pool.id}/apply/", {"profile": "h100-4g-3g", "drain": "preempt"})
    assert drive_partition_change(response.json()["id"]) == "succeeded"
    paths = [r.path for r in cluster.requests if r.method in ("POST", "PATCH")]
    eviction = next(i for i, path in enumerate(paths) if path.endswith("/eviction"))
    configmap = next(i for i, path in enumerate(paths) if "/configmaps" in path)
    assert eviction < configmap
    assert cluster.get("pods", "job-7", "acme-train") is None
