"""What re-partitioning a node means to the NVIDIA GPU Operator, as pure functions.

The rendering itself (labels, mig-parted entry, device plugin config) is
`runners.nvidia.gpu_operator.node_partition_request`, which the partition
page's preview shows too. This module adapts it to a backend `PartitionSpec`
and reads a Node object to tell when MIG Manager and the device plugin are done.
"""

from __future__ import annotations

from runners.backends.base import PartitionSpec
from runners.nvidia import gpu_operator, names


def partition_request(spec: PartitionSpec) -> gpu_operator.NodePartitionRequest:
    """The one rendering of applying `spec` to a node."""
    return gpu_operator.node_partition_request(
        name=spec.name, kind=spec.kind, gpu_model_name=spec.gpu_model, layout=spec.layout, replicas=spec.replicas
    )


def partition_done(node: dict, spec: PartitionSpec) -> bool:
    """Whether a Node object (as JSON) shows the partition applied and its resources advertised."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    gpu_count = int(labels.get(names.GPU_COUNT_LABEL, "0") or 0)
    if spec.kind == names.MIG and labels.get(names.MIG_CONFIG_STATE_LABEL) != names.MIG_CONFIG_STATE_SUCCESS:
        return False
    if labels.get(names.MIG_CONFIG_LABEL) != partition_request(spec).node_labels[names.MIG_CONFIG_LABEL]:
        return False
    gpu_resources = {
        key: int(value)
        for key, value in allocatable.items()
        if key.startswith(names.GPU_RESOURCE) or key.startswith(names.MIG_RESOURCE_PREFIX)
    }
    expected = {key: value for key, value in spec.expected_resources(gpu_count).items() if value}
    return {key: value for key, value in gpu_resources.items() if value} == expected


def partition_failed(node: dict) -> bool:
    """MIG Manager gave up on the node's requested layout."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    return labels.get(names.MIG_CONFIG_STATE_LABEL) == names.MIG_CONFIG_STATE_FAILED
