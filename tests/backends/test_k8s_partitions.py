"""The GPU Operator side of a partition change: labels, ConfigMap entries, and when it is done."""

import pytest
import yaml

from runners.backends.base import PartitionSpec
from runners.backends.k8s_partitions import partition_done, partition_failed, partition_request

pytestmark = pytest.mark.unit

MIG = PartitionSpec(name="h100-4g-3g", gpu_model="H100-80GB", kind="mig", layout=("4g.40gb", "3g.40gb"))
SHARED = PartitionSpec(name="t4-share-4", gpu_model="T4", kind="timeslice", replicas=4)
WHOLE = PartitionSpec(name="h100-whole", gpu_model="H100-80GB", kind="whole")


def node_partition_labels(spec):
    return {key: value for key, value in partition_request(spec).node_labels.items() if key != "nvidia.com/mig.config.state"}


def merged_mig_parted_config(existing, spec):
    return partition_request(spec).mig_parted_config_text(existing)


def device_plugin_config(spec):
    return partition_request(spec).device_plugin_config


def _node(labels, allocatable):
    return {"metadata": {"name": "n", "labels": labels}, "status": {"allocatable": {"cpu": "8", **allocatable}}}


def test_labels_select_the_mig_layout_or_the_time_slicing_config():
    assert node_partition_labels(MIG) == {"nvidia.com/mig.config": "h100-4g-3g", "nvidia.com/device-plugin.config": None}
    assert node_partition_labels(SHARED) == {
        "nvidia.com/mig.config": "all-disabled",
        "nvidia.com/device-plugin.config": "t4-share-4",
    }
    assert node_partition_labels(WHOLE)["nvidia.com/mig.config"] == "all-disabled"


def test_every_request_forgets_mig_managers_last_answer():
    for spec in (MIG, SHARED, WHOLE):
        assert partition_request(spec).node_labels["nvidia.com/mig.config.state"] is None


def test_the_mig_parted_config_keeps_other_entries():
    existing = yaml.safe_dump({"version": "v1", "mig-configs": {"all-1g.10gb": [{"devices": "all", "mig-enabled": True, "mig-devices": {"1g.10gb": 7}}]}})
    merged = yaml.safe_load(merged_mig_parted_config(existing, MIG))
    assert set(merged["mig-configs"]) == {"all-1g.10gb", "all-disabled", "h100-4g-3g"}
    assert merged["mig-configs"]["h100-4g-3g"] == [
        {"devices": "all", "mig-enabled": True, "mig-devices": {"4g.40gb": 1, "3g.40gb": 1}}
    ]
    assert yaml.safe_load(merged_mig_parted_config(None, MIG))["version"] == "v1"


def test_the_time_slicing_config_renames_shared_replicas():
    config = yaml.safe_load(device_plugin_config(SHARED))
    assert config["sharing"]["timeSlicing"] == {"renameByDefault": True, "resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}


def test_mig_is_done_only_when_mig_manager_succeeded_and_resources_show():
    labels = {"nvidia.com/gpu.count": "8", "nvidia.com/mig.config": "h100-4g-3g"}
    resources = {"nvidia.com/mig-4g.40gb": "8", "nvidia.com/mig-3g.40gb": "8"}
    assert not partition_done(_node({**labels, "nvidia.com/mig.config.state": "pending"}, resources), MIG)
    assert not partition_done(_node({**labels, "nvidia.com/mig.config.state": "success"}, {"nvidia.com/gpu": "8"}), MIG)
    assert partition_done(_node({**labels, "nvidia.com/mig.config.state": "success"}, resources), MIG)
    assert partition_failed(_node({**labels, "nvidia.com/mig.config.state": "failed"}, {}))


def test_time_slicing_is_done_when_the_shared_resource_is_advertised():
    labels = {"nvidia.com/gpu.count": "4", "nvidia.com/mig.config": "all-disabled"}
    assert not partition_done(_node(labels, {"nvidia.com/gpu": "4"}), SHARED)
    assert partition_done(_node(labels, {"nvidia.com/gpu.shared": "16", "nvidia.com/gpu": "0"}), SHARED)
