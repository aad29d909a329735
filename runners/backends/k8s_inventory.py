"""Turn Kubernetes Node objects into the portal's inventory, from GPU feature discovery labels.

Pure functions over the JSON the API server returns, so they are tested without
a cluster. GFD (part of the NVIDIA GPU Operator) labels each GPU node with its
product, count and memory; the device plugin reports the extended resources in
`status.allocatable`; topology comes from labels an operator sets.
"""

from __future__ import annotations

from dataclasses import dataclass

from runners.backends.base import GpuInfo, NodeInfo
from runners.backends.k8s_client import parse_quantity
from runners.nvidia import catalog, mig, names


@dataclass(frozen=True)
class TopologyLabels:
    """Which node labels carry the pool and topology; clusters name these differently.

    No defaults: they are the KUBERNETES_*_LABEL settings, defaulted in portal/settings.py.
    """

    pool: str
    rack: str
    block: str
    nvlink_domain: str


def parse_quantity_milli(value: str) -> int:
    """A CPU quantity ("8", "7500m", "1e3") in millicores."""
    return int(parse_quantity(str(value)) * 1000)


def parse_quantity_mib(value: str) -> int:
    """A memory quantity ("64Gi", "65536Mi", "129e6", "68719476736") in MiB."""
    return int(parse_quantity(str(value)) / 1048576)


def node_info(node: dict, *, labels: TopologyLabels) -> NodeInfo:
    """One Node object (as JSON) as a NodeInfo."""
    metadata = node.get("metadata", {})
    node_labels: dict[str, str] = dict(metadata.get("labels") or {})
    allocatable: dict[str, str] = dict((node.get("status") or {}).get("allocatable") or {})
    name = metadata["name"]
    gpu_resources = {
        key: int(value)
        for key, value in allocatable.items()
        if key == names.GPU_RESOURCE or key == names.TIMESLICE_RESOURCE or key.startswith(names.MIG_RESOURCE_PREFIX)
    }
    gpus = _gpus(node_labels, gpu_resources)
    nvlink_domain = node_labels.get(labels.nvlink_domain) or node_labels.get(names.GPU_CLIQUE_LABEL, "")
    if not nvlink_domain and len(gpus) > 1:
        # Without a label, the GPUs of one node are taken to share its NVLink/NVSwitch fabric.
        nvlink_domain = name
    return NodeInfo(
        name=name,
        cpu_milli=parse_quantity_milli(allocatable.get("cpu", "0")),
        memory_mib=parse_quantity_mib(allocatable.get("memory", "0")),
        pool=node_labels.get(labels.pool, ""),
        rack=node_labels.get(labels.rack, ""),
        block=node_labels.get(labels.block, ""),
        nvlink_domain=nvlink_domain,
        labels=node_labels,
        schedulable=not (node.get("spec") or {}).get("unschedulable", False),
        gpus=gpus,
        gpu_resources=gpu_resources,
    )


def _gpus(labels: dict[str, str], resources: dict[str, int]) -> tuple[GpuInfo, ...]:
    product = labels.get(names.GPU_PRODUCT_LABEL)
    count = int(labels.get(names.GPU_COUNT_LABEL, "0") or 0)
    if not product or count == 0:
        return ()
    try:
        model = catalog.model_for_product_label(product).name
    except mig.MigError:
        model = product  # A GPU the catalog does not know: listed, never partitioned.
    memory_mib = int(labels.get(names.GPU_MEMORY_LABEL, "0") or 0)
    mig_resources = {key: value for key, value in resources.items() if key.startswith(names.MIG_RESOURCE_PREFIX)}
    if mig_resources and model in mig.GPU_MODELS and mig.GPU_MODELS[model].mig_capable:
        layout = _uniform_mig_layout(model, mig_resources, count)
        if layout is not None:
            return tuple(
                GpuInfo(index=i, model=model, memory_mib=memory_mib, partition_kind="mig", mig_layout=layout)
                for i in range(count)
            )
    if names.TIMESLICE_RESOURCE in resources:
        replicas = max(resources[names.TIMESLICE_RESOURCE] // count, 1)
        return tuple(
            GpuInfo(index=i, model=model, memory_mib=memory_mib, partition_kind="timeslice", timeslice_replicas=replicas)
            for i in range(count)
        )
    return tuple(GpuInfo(index=i, model=model, memory_mib=memory_mib) for i in range(count))


def _uniform_mig_layout(model: str, mig_resources: dict[str, int], gpu_count: int) -> tuple[tuple[str, int], ...] | None:
    """The per-GPU layout when every GPU is cut alike (how the portal's profiles cut them)."""
    by_resource = {profile.kubernetes_resource: profile.name for profile in mig.profiles_for(model).values()}
    profiles: list[str] = []
    for resource, total in sorted(mig_resources.items()):
        if resource not in by_resource or total % gpu_count:
            return None
        profiles += [by_resource[resource]] * (total // gpu_count)
    try:
        return tuple(mig.fit_layout(model, profiles))
    except mig.MigError:
        return None
