"""Inventory, cordons, evictions and partitions through the Kubernetes backend and the stand-in."""

import time

import pytest
import yaml

from runners.backends.base import PartitionSpec, PermanentBackendError
from tests.support.k8s import gpu_node, portal_pod
from tests.support.k8s_standin import DEVICE_PLUGIN_CONFIG_MAP, GPU_OPERATOR_NAMESPACE, MIG_PARTED_CONFIG_MAP

pytestmark = pytest.mark.e2e

MIG = PartitionSpec(name="h100-4g-3g", gpu_model="H100-80GB", kind="mig", layout=("4g.40gb", "3g.40gb"))
SHARED = PartitionSpec(name="h100-share-4", gpu_model="H100-80GB", kind="timeslice", replicas=4)


@pytest.fixture
def nodes(standin):
    standin.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "acme-train"}})
    standin.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": GPU_OPERATOR_NAMESPACE}})
    for name in ("gpu-1", "gpu-2"):
        standin.put(gpu_node(name))
    standin.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cpu-1", "labels": {}}, "spec": {},
                 "status": {"allocatable": {"cpu": "32", "memory": "128Gi"}}})


def _wait_applied(backend, node, spec, *, tries=200):
    import time

    for _ in range(tries):
        if backend.partition_applied(node, spec):
            return True
        time.sleep(0.01)
    return False


def test_the_inventory_lists_gpu_nodes_with_pool_and_topology(backend, nodes):
    inventory = {node.name: node for node in backend.discover_inventory()}
    assert sorted(inventory) == ["gpu-1", "gpu-2"], "a CPU-only node outside any pool is not GPU inventory"
    assert (inventory["gpu-1"].pool, inventory["gpu-1"].rack, len(inventory["gpu-1"].gpus)) == ("h100-pool", "rack-a", 8)


def test_cordon_and_uncordon_patch_the_node(backend, standin, nodes):
    backend.cordon("gpu-1")
    assert standin.get("nodes", "gpu-1")["spec"]["unschedulable"] is True
    backend.uncordon("gpu-1")
    assert "unschedulable" not in standin.get("nodes", "gpu-1")["spec"]
    assert {r.content_type for r in standin.requests if r.method == "PATCH"} == {"application/merge-patch+json"}


def test_only_unfinished_portal_pods_count_as_work(backend, standin, nodes):
    standin.put(portal_pod("job-7", "gpu-1"))
    standin.put(portal_pod("job-6", "gpu-1", phase="Succeeded"))
    standin.put(portal_pod("job-9", "gpu-2"))
    other = portal_pod("dcgm-exporter", "gpu-1", namespace="acme-train")
    other["metadata"]["labels"] = {"app": "dcgm-exporter"}
    standin.put(other)
    assert backend.node_workloads("gpu-1") == ["acme-train/job-7"]


def test_evicting_uses_the_eviction_api(backend, standin, nodes):
    standin.put(portal_pod("job-7", "gpu-1"))
    backend.evict("gpu-1", "acme-train/job-7", grace_period_s=60)
    # Eviction is a graceful delete: the pod is Terminating until its container stops, then goes.
    assert standin.get("pods", "job-7", "acme-train")["metadata"]["deletionGracePeriodSeconds"] == 60
    deadline = time.monotonic() + 10
    while backend.node_workloads("gpu-1") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert backend.node_workloads("gpu-1") == []
    assert any(r.path.endswith("/pods/job-7/eviction") and r.status == 201 for r in standin.requests)
    backend.evict("gpu-1", "acme-train/job-7", grace_period_s=60)  # already gone: fine


def test_a_mig_partition_writes_the_config_then_the_label_and_waits_for_the_operator(backend, standin, nodes):
    backend.apply_partition("gpu-1", MIG)
    config = yaml.safe_load(standin.get("configmaps", MIG_PARTED_CONFIG_MAP, GPU_OPERATOR_NAMESPACE)["data"]["config.yaml"])
    assert config["mig-configs"]["h100-4g-3g"][0]["mig-devices"] == {"4g.40gb": 1, "3g.40gb": 1}
    assert standin.get("nodes", "gpu-1")["metadata"]["labels"]["nvidia.com/mig.config"] == "h100-4g-3g"
    assert _wait_applied(backend, "gpu-1", MIG)
    allocatable = standin.get("nodes", "gpu-1")["status"]["allocatable"]
    assert (allocatable["nvidia.com/mig-4g.40gb"], allocatable["nvidia.com/mig-3g.40gb"]) == ("8", "8")
    node = next(n for n in backend.discover_inventory() if n.name == "gpu-1")
    assert sorted(node.gpus[0].mig_layout) == [("3g.40gb", 4), ("4g.40gb", 0)]


def test_a_second_profile_keeps_the_first_in_the_config_map(backend, standin, nodes):
    backend.apply_partition("gpu-1", MIG)
    other = PartitionSpec(name="h100-7x1g", gpu_model="H100-80GB", kind="mig", layout=("1g.10gb",) * 7)
    backend.apply_partition("gpu-2", other)
    config = yaml.safe_load(standin.get("configmaps", MIG_PARTED_CONFIG_MAP, GPU_OPERATOR_NAMESPACE)["data"]["config.yaml"])
    assert {"h100-4g-3g", "h100-7x1g", "all-disabled"} <= set(config["mig-configs"])


def test_time_slicing_goes_through_the_device_plugin_config(backend, standin, nodes):
    backend.apply_partition("gpu-2", SHARED)
    data = standin.get("configmaps", DEVICE_PLUGIN_CONFIG_MAP, GPU_OPERATOR_NAMESPACE)["data"]
    assert yaml.safe_load(data["h100-share-4"])["sharing"]["timeSlicing"]["resources"] == [{"name": "nvidia.com/gpu", "replicas": 4}]
    labels = standin.get("nodes", "gpu-2")["metadata"]["labels"]
    assert labels["nvidia.com/device-plugin.config"] == "h100-share-4" and labels["nvidia.com/mig.config"] == "all-disabled"
    assert _wait_applied(backend, "gpu-2", SHARED)
    assert standin.get("nodes", "gpu-2")["status"]["allocatable"]["nvidia.com/gpu.shared"] == "32"


def test_a_layout_mig_manager_cannot_find_fails_permanently(backend, standin, nodes):
    backend._patch_node("gpu-1", {"metadata": {"labels": {"nvidia.com/mig.config": "no-such-layout"}}})
    with pytest.raises(PermanentBackendError, match="mig.config.state=failed"):
        _wait_applied(backend, "gpu-1", MIG)


def test_a_stale_config_map_write_is_retried(backend, standin, nodes):
    backend.apply_partition("gpu-1", MIG)
    standin.inject(409, method="PUT", reason="Conflict", message="the object has been modified")
    other = PartitionSpec(name="h100-7x1g", gpu_model="H100-80GB", kind="mig", layout=("1g.10gb",) * 7)
    backend.apply_partition("gpu-2", other)
    config = yaml.safe_load(standin.get("configmaps", MIG_PARTED_CONFIG_MAP, GPU_OPERATOR_NAMESPACE)["data"]["config.yaml"])
    assert "h100-7x1g" in config["mig-configs"]


def test_a_node_with_an_unreadable_quantity_does_not_hide_the_others(backend, standin, nodes):
    broken = gpu_node("gpu-odd")
    broken["status"]["allocatable"]["memory"] = "lots"
    standin.put(broken)
    assert sorted(node.name for node in backend.discover_inventory()) == ["gpu-1", "gpu-2"]
