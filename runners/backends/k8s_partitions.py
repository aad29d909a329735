"""What re-partitioning a node means to the NVIDIA GPU Operator, as pure functions.

MIG Manager watches the node label `nvidia.com/mig.config` and applies that
entry of its mig-parted ConfigMap, then sets `nvidia.com/mig.config.state`;
the device plugin watches `nvidia.com/device-plugin.config` and serves that key
of its ConfigMap (time-slicing). The backend writes the ConfigMap entries and
labels these functions compute, then waits until `partition_done` holds.
"""

from __future__ import annotations

import yaml

from quotas import catalog, nvidia_configs
from runners.backends.base import PartitionSpec
from runners.scheduler import mig

MIG_CONFIG_STATE_SUCCESS = "success"
MIG_CONFIG_STATE_FAILED = "failed"


def node_partition_labels(spec: PartitionSpec) -> dict[str, str | None]:
    """Labels to merge-patch onto a node; None removes a label."""
    if spec.kind == "mig":
        return {nvidia_configs.MIG_CONFIG_LABEL: spec.name, nvidia_configs.DEVICE_PLUGIN_CONFIG_LABEL: None}
    if spec.kind == "timeslice":
        return {
            nvidia_configs.MIG_CONFIG_LABEL: nvidia_configs.ALL_DISABLED,
            nvidia_configs.DEVICE_PLUGIN_CONFIG_LABEL: spec.name,
        }
    return {nvidia_configs.MIG_CONFIG_LABEL: nvidia_configs.ALL_DISABLED, nvidia_configs.DEVICE_PLUGIN_CONFIG_LABEL: None}


def merged_mig_parted_config(existing_yaml: str | None, spec: PartitionSpec) -> str:
    """The mig-parted config.yaml with the profile's entry added (or replaced), others kept."""
    existing = yaml.safe_load(existing_yaml) if existing_yaml else None
    configs = dict((existing or {}).get("mig-configs") or {})
    ours = nvidia_configs.mig_parted_config({spec.name: list(spec.layout)}, gpu_model_name=spec.gpu_model)
    configs.update(ours["mig-configs"])
    return nvidia_configs.to_yaml({"version": nvidia_configs.CONFIG_VERSION, "mig-configs": configs})


def device_plugin_config(spec: PartitionSpec) -> str:
    """The device plugin config (one ConfigMap key) for a time-slicing profile."""
    return nvidia_configs.render_time_slicing_config({catalog.GPU_RESOURCE: spec.replicas}, rename_by_default=True)


def partition_done(node: dict, spec: PartitionSpec) -> bool:
    """Whether a Node object (as JSON) shows the partition applied and its resources advertised."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    gpu_count = int(labels.get("nvidia.com/gpu.count", "0") or 0)
    if spec.kind == "mig" and labels.get(nvidia_configs.MIG_CONFIG_STATE_LABEL) != MIG_CONFIG_STATE_SUCCESS:
        return False
    if labels.get(nvidia_configs.MIG_CONFIG_LABEL) != node_partition_labels(spec)[nvidia_configs.MIG_CONFIG_LABEL]:
        return False
    gpu_resources = {
        key: int(value)
        for key, value in allocatable.items()
        if key.startswith(catalog.GPU_RESOURCE) or key.startswith(mig.MIG_RESOURCE_PREFIX)
    }
    expected = {key: value for key, value in spec.expected_resources(gpu_count).items() if value}
    return {key: value for key, value in gpu_resources.items() if value} == expected


def partition_failed(node: dict) -> bool:
    """MIG Manager gave up on the node's requested layout."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    return labels.get(nvidia_configs.MIG_CONFIG_STATE_LABEL) == MIG_CONFIG_STATE_FAILED
