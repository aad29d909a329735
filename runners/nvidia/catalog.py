"""The GPU catalog: models, MIG profiles, and what each flavor kind is called in Kubernetes.

Pure Python (no Django), so models, services and the scheduler can all use it. The MIG
geometry lives in `runners.nvidia.mig` and the names in `runners.nvidia.names`; this module
adds the Kubernetes side of a flavor: the extended resource a pod requests for each flavor
kind, and the node labels that the GPU Operator's components put on a node that offers it
(GPU feature discovery and the device plugin).

Sources for the names:
* Whole GPUs are `nvidia.com/gpu`. GFD labels the node `nvidia.com/gpu.product=<NVML name
  with spaces as dashes>`, e.g. `NVIDIA-H100-80GB-HBM3`, `Tesla-T4`.
* MIG with the `mixed` strategy: one resource per profile, `nvidia.com/mig-1g.10gb`, with
  `+` turned into `.` (`nvidia.com/mig-1g.10gb.me`); the node carries
  `nvidia.com/mig.strategy=mixed` and the mig-parted layout in `nvidia.com/mig.config`.
* Time-slicing: the device plugin advertises `replicas` units per GPU. With
  `renameByDefault: true` the resource becomes `nvidia.com/gpu.shared` and the product
  label is unchanged; with the default `false` the resource stays `nvidia.com/gpu` and GFD
  suffixes the product label with `-SHARED` (GPU Operator, "Time-Slicing GPUs in
  Kubernetes"). GFD also sets `nvidia.com/gpu.replicas=<replicas>`.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from runners.nvidia.mig import (
    COMPUTE_SLICES,
    GPU_MODELS,
    GpuModel,
    LayoutError,
    UnknownGpuModelError,
    gpu_model,
    profiles_for,
)
from runners.nvidia.names import (
    GPU_PRODUCT_LABEL,
    GPU_REPLICAS_LABEL,
    GPU_RESOURCE,
    MIG_STRATEGY_LABEL,
    SHARED_PRODUCT_SUFFIX,
    SHARED_RESOURCE_SUFFIX,
)

__all__ = [
    "FlavorKind",
    "FlavorSpec",
    "mig_flavor",
    "model_for_product_label",
    "time_sliced_flavor",
    "whole_gpu_flavor",
]


# Flavor names become Kubernetes object names and label values: lowercase DNS-1123 subdomain
# characters, at most 63 long.
_FLAVOR_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$")


class FlavorKind(enum.StrEnum):
    """How a unit of GPU capacity is cut out of a physical GPU."""

    WHOLE_GPU = "gpu"
    MIG = "mig"
    TIME_SLICED = "time-sliced"


@dataclass(frozen=True)
class FlavorSpec:
    """What a resource flavor means on a cluster: the resource a pod requests and where it lands."""

    name: str
    kind: FlavorKind
    gpu_model: str
    kubernetes_resource: str
    # Labels every node offering this flavor carries: a pod's nodeSelector, a quota flavor's nodeLabels.
    node_labels: Mapping[str, str] = field(hash=False)
    # One unit's share of a physical GPU in thousandths, for fair share and cost:
    # a whole GPU is 1000, a 3g slice 3/7 of the compute, a replica of 4 is 250.
    gpu_milli: int
    memory_mib: int
    # Every `nvidia.com/gpu.product` value that offers this flavor (SXM and PCIe boards, older
    # drivers), for a node affinity `In` term where one nodeSelector value is too narrow.
    product_labels: tuple[str, ...] = ()
    mig_profile: str | None = None
    replicas: int | None = None


def _flavor_name(*parts: str) -> str:
    name = "-".join(parts).lower().replace("+", ".")
    if not _FLAVOR_NAME.match(name):
        raise ValueError(f"flavor name {name!r} is not a valid Kubernetes name (lowercase, [-a-z0-9.], at most 63)")
    return name


def whole_gpu_flavor(model: str) -> FlavorSpec:
    """A whole GPU of `model`, requested as `nvidia.com/gpu` on nodes GFD labels with its product."""
    entry = gpu_model(model)
    return FlavorSpec(
        name=_flavor_name(entry.name),
        kind=FlavorKind.WHOLE_GPU,
        gpu_model=entry.name,
        kubernetes_resource=GPU_RESOURCE,
        node_labels=MappingProxyType({GPU_PRODUCT_LABEL: entry.product_label}),
        gpu_milli=1000,
        memory_mib=entry.memory_mib,
        product_labels=entry.product_labels,
    )


def mig_flavor(model: str, profile_name: str) -> FlavorSpec:
    """One MIG slice, requested as `nvidia.com/mig-<profile>` under the device plugin's mixed strategy."""
    profiles = profiles_for(model)
    if profile_name not in profiles:
        raise LayoutError(f"unknown MIG profile {profile_name!r} for {model}; valid profiles: {', '.join(profiles)}")
    profile = profiles[profile_name]
    entry = gpu_model(model)
    return FlavorSpec(
        name=_flavor_name(entry.name, "mig", profile.name),
        kind=FlavorKind.MIG,
        gpu_model=entry.name,
        kubernetes_resource=profile.kubernetes_resource,
        node_labels=MappingProxyType({GPU_PRODUCT_LABEL: entry.product_label, MIG_STRATEGY_LABEL: "mixed"}),
        # Compute is what a slice takes away from others; 7g is the whole GPU.
        gpu_milli=profile.compute_slices * 1000 // COMPUTE_SLICES,
        memory_mib=profile.memory_mib,
        product_labels=entry.product_labels,
        mig_profile=profile.name,
    )


def time_sliced_flavor(model: str, replicas: int, *, rename_by_default: bool = False) -> FlavorSpec:
    """One time-slicing replica of a whole GPU; the names follow the device plugin's renameByDefault."""
    entry = gpu_model(model)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 2:
        raise ValueError(f"replicas must be an integer of at least 2 to share a GPU, got {replicas!r}")
    if rename_by_default:
        resource, suffix = GPU_RESOURCE + SHARED_RESOURCE_SUFFIX, ""
    else:
        resource, suffix = GPU_RESOURCE, SHARED_PRODUCT_SUFFIX
    product = entry.product_label + suffix
    return FlavorSpec(
        name=_flavor_name(entry.name, "shared", str(replicas)),
        kind=FlavorKind.TIME_SLICED,
        gpu_model=entry.name,
        kubernetes_resource=resource,
        node_labels=MappingProxyType({GPU_PRODUCT_LABEL: product, GPU_REPLICAS_LABEL: str(replicas)}),
        # Replicas share compute and memory with no isolation; the nominal share is 1/replicas.
        gpu_milli=1000 // replicas,
        memory_mib=entry.memory_mib // replicas,
        product_labels=tuple(label + suffix for label in entry.product_labels),
        replicas=replicas,
    )


def model_for_product_label(product_label: str) -> GpuModel:
    """The catalog model behind a `nvidia.com/gpu.product` value, including GFD's -SHARED and -MIG-<profile> forms."""
    # GFD appends -SHARED for time-slicing and -MIG-<profile> under the single MIG strategy.
    base = product_label.removesuffix(SHARED_PRODUCT_SUFFIX)
    base = re.sub(r"-MIG-\d+g\.\d+gb(\+me)?$", "", base)
    for entry in GPU_MODELS.values():
        if base in entry.product_labels:
            return entry
    known = ", ".join(label for entry in GPU_MODELS.values() for label in entry.product_labels)
    raise UnknownGpuModelError(f"no GPU model in the catalog has product label {product_label!r}; known labels: {known}")
