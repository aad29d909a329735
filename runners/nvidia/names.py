"""Every name NVIDIA's Kubernetes components use that the portal reads or writes, in one place.

The GPU Operator's parts talk to each other through node labels and extended resources:
GPU feature discovery (GFD) labels what a node has, the device plugin advertises resources,
MIG Manager applies the layout a label asks for and reports in another label. Nothing else in
the portal spells one of these strings; it imports it from here.

Sources: the GPU Operator documentation ("GPU Feature Discovery", "MIG Support in Kubernetes",
"Time-Slicing GPUs in Kubernetes") and k8s-device-plugin's `AddDefaultResourcesToConfig`.
"""

from typing import Final, Literal

DOMAIN: Final = "nvidia.com"

# --- Extended resources a pod requests ----------------------------------------

# A whole GPU.
GPU_RESOURCE: Final = "nvidia.com/gpu"
# The device plugin's DefaultSharedResourceNameSuffix: with renameByDefault a time-sliced
# GPU is advertised as nvidia.com/gpu.shared.
SHARED_RESOURCE_SUFFIX: Final = ".shared"
TIMESLICE_RESOURCE: Final = GPU_RESOURCE + SHARED_RESOURCE_SUFFIX
# The `mixed` MIG strategy advertises one resource per profile: nvidia.com/mig-1g.10gb.
MIG_RESOURCE_PREFIX: Final = "nvidia.com/mig-"
# ResourceQuota keys for extended resources are the resource with this prefix.
QUOTA_REQUESTS_PREFIX: Final = "requests."

# --- Node labels GFD sets -----------------------------------------------------

GPU_PRODUCT_LABEL: Final = "nvidia.com/gpu.product"
GPU_COUNT_LABEL: Final = "nvidia.com/gpu.count"
GPU_MEMORY_LABEL: Final = "nvidia.com/gpu.memory"
GPU_REPLICAS_LABEL: Final = "nvidia.com/gpu.replicas"
# The NVLink domain (NVL72 and similar): GFD's clique label, "<cluster uuid>.<clique id>".
GPU_CLIQUE_LABEL: Final = "nvidia.com/gpu.clique"
MIG_STRATEGY_LABEL: Final = "nvidia.com/mig.strategy"
# GFD's suffix on the product label of a time-sliced GPU when the resource is not renamed.
SHARED_PRODUCT_SUFFIX: Final = "-SHARED"

# --- Labels that ask the operator for a partition, and its answers ----------------

# MIG Manager applies the mig-parted entry this label names.
MIG_CONFIG_LABEL: Final = "nvidia.com/mig.config"
# ... and reports its progress here.
MIG_CONFIG_STATE_LABEL: Final = "nvidia.com/mig.config.state"
MIG_CONFIG_STATE_PENDING: Final = "pending"
MIG_CONFIG_STATE_REBOOTING: Final = "rebooting"
MIG_CONFIG_STATE_SUCCESS: Final = "success"
MIG_CONFIG_STATE_FAILED: Final = "failed"
# The device plugin serves the key of its ConfigMap this label names.
DEVICE_PLUGIN_CONFIG_LABEL: Final = "nvidia.com/device-plugin.config"
# Every mig-parted config the portal writes has this entry, so a node can go back to whole GPUs.
MIG_ALL_DISABLED: Final = "all-disabled"

# --- The GPU Operator's own objects ---------------------------------------------

GPU_OPERATOR_NAMESPACE: Final = "gpu-operator"
# The ConfigMap the GPU Operator creates for MIG Manager; a custom one replaces it by name.
DEFAULT_MIG_PARTED_CONFIG_MAP: Final = "default-mig-parted-config"
MIG_PARTED_CONFIG_KEY: Final = "config.yaml"

# --- The DCGM exporter: the fields the portal reads and the labels on each series -----
# From dcgm-exporter's counters file (dcp-metrics-included.csv) and its Kubernetes pod attribution.

DCGM_GPU_UTIL: Final = "DCGM_FI_DEV_GPU_UTIL"  # percent; not reported for a MIG instance
DCGM_GR_ENGINE_ACTIVE: Final = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"  # ratio, 0..1
DCGM_FB_USED: Final = "DCGM_FI_DEV_FB_USED"  # MiB
DCGM_POWER_USAGE: Final = "DCGM_FI_DEV_POWER_USAGE"  # W
DCGM_UUID_LABEL: Final = "UUID"
DCGM_GPU_LABEL: Final = "gpu"
DCGM_MODEL_LABEL: Final = "modelName"
DCGM_HOSTNAME_LABEL: Final = "Hostname"
DCGM_MIG_PROFILE_LABEL: Final = "GPU_I_PROFILE"
DCGM_MIG_INSTANCE_LABEL: Final = "GPU_I_ID"

# --- How a GPU is cut: the portal's one spelling of partition kinds ----------------

PartitionKindName = Literal["whole", "mig", "timeslice"]
WHOLE: Final = "whole"
MIG: Final = "mig"
TIMESLICE: Final = "timeslice"
PARTITION_KINDS: Final = (WHOLE, MIG, TIMESLICE)


def mig_resource(profile: str) -> str:
    """The `mixed`-strategy resource of a MIG profile: `1g.10gb+me` -> `nvidia.com/mig-1g.10gb.me`."""
    return MIG_RESOURCE_PREFIX + profile.replace("+", ".")


def is_nvidia_resource(name: str) -> bool:
    """Whether an extended resource (or a ResourceQuota key for one) is NVIDIA's."""
    return name.removeprefix(QUOTA_REQUESTS_PREFIX).startswith(DOMAIN + "/")
