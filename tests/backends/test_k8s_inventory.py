"""Reading the inventory from Kubernetes Node objects and GPU feature discovery labels."""

import pytest

from runners.backends.k8s_inventory import node_info as _node_info
from runners.backends.k8s_inventory import parse_quantity_mib, parse_quantity_milli
from runners.clusters.registry import kubernetes_backend_options

pytestmark = pytest.mark.unit


def node_info(node: dict):
    """Read a node with the topology labels the settings name."""
    return _node_info(node, labels=kubernetes_backend_options()["topology_labels"])


def _node(name="gpu-1", labels=None, allocatable=None, unschedulable=False):
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"unschedulable": unschedulable},
        "status": {"allocatable": {"cpu": "96", "memory": "1Ti", **(allocatable or {})}},
    }


H100_LABELS = {
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.count": "8",
    "nvidia.com/gpu.memory": "81559",
    "portal.gpu/node-pool": "h100-pool",
    "topology.portal.gpu/rack": "rack-a",
}


def test_quantities_parse_to_milli_cpu_and_mib():
    assert parse_quantity_milli("7500m") == 7500
    assert parse_quantity_milli("8") == 8000
    assert parse_quantity_mib("64Gi") == 65536
    assert parse_quantity_mib("1024Ki") == 1
    assert parse_quantity_mib(str(2 * 1048576)) == 2


def test_a_whole_gpu_node_is_read_from_gfd_labels():
    info = node_info(_node(labels=H100_LABELS, allocatable={"nvidia.com/gpu": "8"}))
    assert (info.pool, info.rack, info.cpu_milli, info.memory_mib) == ("h100-pool", "rack-a", 96000, 1048576)
    assert len(info.gpus) == 8 and {gpu.model for gpu in info.gpus} == {"H100-80GB"}
    assert info.gpus[0].memory_mib == 81559
    assert info.nvlink_domain == "gpu-1", "a node's own GPUs share its NVSwitch when no label says otherwise"
    assert info.gpu_resources == {"nvidia.com/gpu": 8}


def test_a_mixed_mig_node_gets_its_per_gpu_layout_back():
    info = node_info(
        _node(labels=H100_LABELS, allocatable={"nvidia.com/mig-4g.40gb": "8", "nvidia.com/mig-3g.40gb": "8"})
    )
    assert info.gpus[0].partition_kind == "mig"
    assert sorted(info.gpus[0].mig_layout) == [("3g.40gb", 4), ("4g.40gb", 0)]


def test_a_time_sliced_node_reports_replicas_per_gpu():
    labels = {"nvidia.com/gpu.product": "Tesla-T4", "nvidia.com/gpu.count": "4", "nvidia.com/gpu.replicas": "4"}
    info = node_info(_node(labels=labels, allocatable={"nvidia.com/gpu.shared": "16"}))
    assert [(gpu.model, gpu.partition_kind, gpu.timeslice_replicas) for gpu in info.gpus] == [("T4", "timeslice", 4)] * 4


def test_a_cordoned_cpu_node_has_no_gpus_and_is_not_schedulable():
    info = node_info(_node(name="cpu-1", unschedulable=True))
    assert info.gpus == () and not info.schedulable and info.nvlink_domain == ""


def test_a_clique_label_names_the_nvlink_domain():
    info = node_info(_node(labels={**H100_LABELS, "nvidia.com/gpu.clique": "cluster-a.0"}, allocatable={"nvidia.com/gpu": "8"}))
    assert info.nvlink_domain == "cluster-a.0"


def test_every_quantity_form_kubernetes_allows_is_read():
    assert parse_quantity_mib("129e6") == 123
    assert parse_quantity_milli("1e3") == 1_000_000
    assert parse_quantity_mib("1Gi") == 1024
