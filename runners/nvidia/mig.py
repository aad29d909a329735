"""NVIDIA GPU models and their MIG geometry: which profiles exist and where they may be placed.

Pure Python (no Django): the scheduler imports this to decide whether a set of MIG slices fits
on one GPU; `runners.nvidia.catalog` builds the flavors on top of it.

How NVIDIA places GPU instances, and how this module encodes it:

* A MIG-capable GPU has 8 memory slices (positions 0..7) and 7 compute slices. A GPU
  instance of a profile occupies `span` consecutive memory positions from one of the
  profile's allowed start positions. NVML's rule is that "creation of new GPU instance
  will fail if there is overlap with the already occupied memory slices"
  (`nvmlDeviceGetGpuInstancePossiblePlacements_v2`).
* The allowed starts and spans are NVIDIA's own table, as `nvidia-smi mig -lgipp` prints it
  on A100 and H100 (MIG User Guide, "Getting Started with MIG", and identical output
  published from H100 NVL and H100 SXM machines):

      GPU  0 Profile ID 19 Placements: {0,1,2,3,4,5,6}:1     1g.5gb / 1g.10gb / 1g.18gb
      GPU  0 Profile ID 20 Placements: {0,1,2,3,4,5,6}:1     1g.*+me
      GPU  0 Profile ID 15 Placements: {0,2,4,6}:2           1g.10gb / 1g.20gb / 1g.35gb
      GPU  0 Profile ID 14 Placements: {0,2,4}:2             2g.*
      GPU  0 Profile ID  9 Placements: {0,4}:4               3g.*
      GPU  0 Profile ID  5 Placement : {0}:4                 4g.*
      GPU  0 Profile ID  0 Placement : {0}:8                 7g.*

  So a 1g instance may start at 6 but never at 7: position 7 is memory without a compute
  slice of its own, reachable only by the 2-slice profiles starting at 6 and by 3g/7g.
* Instance limits are the "Number of Instances Available" column of the MIG User Guide's
  "Supported MIG Profiles" tables (A100, H100, H200). A `+me` profile carries the GPU's
  only set of media extensions (JPEG decoder and OFA), so at most one `+me` instance
  exists per GPU.
* The Kubernetes device plugin's `mixed` strategy advertises each profile as
  `nvidia.com/mig-<profile>` with `+` replaced by `.` (k8s-device-plugin
  `AddDefaultResourcesToConfig`: `strings.ReplaceAll("mig-"+p.String(), "+", ".")`),
  because `+` is not allowed in a Kubernetes resource name. Its profile patterns are
  unanchored matches, though, and some plugin versions count a `1g.10gb+me` instance under
  `nvidia.com/mig-1g.10gb` (NVIDIA/k8s-device-plugin issue #1462): check a node's capacity
  before promising a separate `.me` resource.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping

from runners.nvidia import names

MEMORY_SLICES = 8
COMPUTE_SLICES = 7
MEDIA_EXTENSIONS_SUFFIX = "+me"

__all__ = [
    "COMPUTE_SLICES",
    "GPU_MODELS",
    "GpuModel",
    "LayoutError",
    "MEMORY_SLICES",
    "MigError",
    "MigNotSupportedError",
    "MigProfile",
    "UnknownGpuModelError",
    "check_placement",
    "fit_layout",
    "fits",
    "free_starts",
    "gpu_model",
    "profiles_for",
    "valid_placement",
]


class MigError(ValueError):
    """Base of every error this module raises; a ValueError so callers validating input catch it."""


class UnknownGpuModelError(MigError, KeyError):
    """The GPU model name is not in the catalog."""

    def __str__(self) -> str:
        # KeyError would print the message in quotes; keep it readable.
        return str(self.args[0]) if self.args else ""


class MigNotSupportedError(MigError):
    """The GPU model exists but cannot be partitioned with MIG."""


class LayoutError(MigError):
    """A set of MIG instances cannot be placed on one GPU; the message says why."""


@dataclass(frozen=True)
class MigProfile:
    """One GPU instance profile, with NVIDIA's placement rule for it."""

    name: str
    compute_slices: int
    memory_slices: int
    memory_mib: int
    max_instances: int
    starts: tuple[int, ...]
    span: int
    # The GPU instance profile ID `nvidia-smi mig -lgip` shows (`-cgi 9` creates a 3g).
    profile_id: int

    @property
    def media_extensions(self) -> bool:
        """True for `+me` profiles, which hold the GPU's single set of media extensions."""
        return self.name.endswith(MEDIA_EXTENSIONS_SUFFIX)

    @property
    def kubernetes_resource(self) -> str:
        """The extended resource the device plugin advertises under the `mixed` strategy."""
        return names.mig_resource(self.name)

    def slots(self, start: int) -> range:
        """The memory positions an instance started at `start` occupies."""
        return range(start, start + self.span)


@dataclass(frozen=True)
class GpuModel:
    """A GPU model the portal knows: memory, the GFD product label, and its MIG profiles."""

    name: str
    memory_mib: int
    mig_capable: bool
    # `nvidia.com/gpu.product` as GPU feature discovery sets it (NVML's name, spaces as dashes).
    product_label: str
    # Other spellings GFD reports for the same model: PCIe/SXM boards and older drivers.
    other_product_labels: tuple[str, ...] = ()
    compute_slices: int = 0
    memory_slices: int = 0
    profiles: Mapping[str, MigProfile] = field(default_factory=lambda: MappingProxyType({}), hash=False)

    @property
    def product_labels(self) -> tuple[str, ...]:
        """Every `nvidia.com/gpu.product` value that means this model."""
        return (self.product_label, *self.other_product_labels)


# NVIDIA's placement table, shared by every A100/H100/H200 (see the module docstring):
# profile kind -> (profile ID, compute slices, starts, span, max instances).
_GEOMETRY_7_8: dict[str, tuple[int, int, tuple[int, ...], int, int]] = {
    "1g": (19, 1, (0, 1, 2, 3, 4, 5, 6), 1, 7),
    "1g+me": (20, 1, (0, 1, 2, 3, 4, 5, 6), 1, 1),
    "1g-2slot": (15, 1, (0, 2, 4, 6), 2, 4),
    "2g": (14, 2, (0, 2, 4), 2, 3),
    "3g": (9, 3, (0, 4), 4, 2),
    "4g": (5, 4, (0,), 4, 1),
    "7g": (0, 7, (0,), 8, 1),
}


def _profiles(names: dict[str, str]) -> Mapping[str, MigProfile]:
    """Build one model's profiles from kind -> NVIDIA profile name."""
    profiles = {}
    for kind, name in names.items():
        profile_id, compute_slices, starts, span, max_instances = _GEOMETRY_7_8[kind]
        # The size in the name is NVIDIA's rounded marketing figure; NVML reports a little
        # less usable memory (1g.10gb on H100 is 9984 MiB). Scheduling uses the nominal size.
        nominal_gb = int(name.split(".")[1].removesuffix(MEDIA_EXTENSIONS_SUFFIX).removesuffix("gb"))
        profiles[name] = MigProfile(
            name=name,
            compute_slices=compute_slices,
            # Every profile's memory fraction equals the positions it spans (User Guide tables).
            memory_slices=span,
            memory_mib=nominal_gb * 1024,
            max_instances=max_instances,
            starts=starts,
            span=span,
            profile_id=profile_id,
        )
    return MappingProxyType(profiles)


def _mig_model(name: str, memory_mib: int, product_label: str, other_labels: tuple[str, ...], names: dict[str, str]) -> GpuModel:
    return GpuModel(
        name=name,
        memory_mib=memory_mib,
        mig_capable=True,
        product_label=product_label,
        other_product_labels=other_labels,
        compute_slices=COMPUTE_SLICES,
        memory_slices=MEMORY_SLICES,
        profiles=_profiles(names),
    )


def _plain_model(name: str, memory_mib: int, product_label: str, other_labels: tuple[str, ...] = ()) -> GpuModel:
    return GpuModel(
        name=name, memory_mib=memory_mib, mig_capable=False, product_label=product_label, other_product_labels=other_labels
    )


# Memory is the nominal capacity (GB on the box x 1024), matching the MIG profile names.
GPU_MODELS: Mapping[str, GpuModel] = MappingProxyType(
    {
        model.name: model
        for model in (
            _mig_model(
                "A100-40GB", 40 * 1024, "NVIDIA-A100-SXM4-40GB", ("NVIDIA-A100-PCIE-40GB", "A100-SXM4-40GB", "A100-PCIE-40GB"),
                {"1g": "1g.5gb", "1g+me": "1g.5gb+me", "1g-2slot": "1g.10gb", "2g": "2g.10gb", "3g": "3g.20gb",
                 "4g": "4g.20gb", "7g": "7g.40gb"},
            ),
            _mig_model(
                "A100-80GB", 80 * 1024, "NVIDIA-A100-SXM4-80GB", ("NVIDIA-A100-80GB-PCIe", "A100-SXM4-80GB", "A100-80GB-PCIe"),
                {"1g": "1g.10gb", "1g+me": "1g.10gb+me", "1g-2slot": "1g.20gb", "2g": "2g.20gb", "3g": "3g.40gb",
                 "4g": "4g.40gb", "7g": "7g.80gb"},
            ),
            _mig_model(
                "H100-80GB", 80 * 1024, "NVIDIA-H100-80GB-HBM3", ("NVIDIA-H100-PCIe",),
                {"1g": "1g.10gb", "1g+me": "1g.10gb+me", "1g-2slot": "1g.20gb", "2g": "2g.20gb", "3g": "3g.40gb",
                 "4g": "4g.40gb", "7g": "7g.80gb"},
            ),
            # H100 NVL (PCIe) and H100 SXM5 94GB; same silicon and placement table as the 80GB part.
            _mig_model(
                "H100-94GB", 94 * 1024, "NVIDIA-H100-NVL", (),
                {"1g": "1g.12gb", "1g+me": "1g.12gb+me", "1g-2slot": "1g.24gb", "2g": "2g.24gb", "3g": "3g.47gb",
                 "4g": "4g.47gb", "7g": "7g.94gb"},
            ),
            _mig_model(
                "H200-141GB", 141 * 1024, "NVIDIA-H200", ("NVIDIA-H200-NVL",),
                {"1g": "1g.18gb", "1g+me": "1g.18gb+me", "1g-2slot": "1g.35gb", "2g": "2g.35gb", "3g": "3g.71gb",
                 "4g": "4g.71gb", "7g": "7g.141gb"},
            ),
            _plain_model("L4", 24 * 1024, "NVIDIA-L4"),
            _plain_model("L40S", 48 * 1024, "NVIDIA-L40S"),
            _plain_model("T4", 16 * 1024, "Tesla-T4"),
            _plain_model("A10", 24 * 1024, "NVIDIA-A10"),
        )
    }
)


def gpu_model(model: str) -> GpuModel:
    """The catalog entry for a model name, or UnknownGpuModelError listing the known names."""
    try:
        return GPU_MODELS[model]
    except KeyError:
        known = ", ".join(GPU_MODELS)
        raise UnknownGpuModelError(f"unknown GPU model {model!r}; known models: {known}") from None


def profiles_for(model: str) -> dict[str, MigProfile]:
    """The MIG profiles of a model, by NVIDIA profile name; raises for unknown or non-MIG models."""
    entry = gpu_model(model)
    if not entry.mig_capable:
        capable = ", ".join(name for name, other in GPU_MODELS.items() if other.mig_capable)
        raise MigNotSupportedError(f"GPU model {model!r} does not support MIG; MIG-capable models: {capable}")
    return dict(entry.profiles)


def _profile(profiles: Mapping[str, MigProfile], model: str, name: str) -> MigProfile:
    try:
        return profiles[name]
    except KeyError:
        raise LayoutError(f"unknown MIG profile {name!r} for {model}; valid profiles: {', '.join(profiles)}") from None


def _check_counts(model: str, profiles: Mapping[str, MigProfile], names: Iterable[str]) -> list[MigProfile]:
    """Reject unknown profiles and multisets over any per-GPU limit, before trying placements."""
    wanted = [_profile(profiles, model, name) for name in names]
    # The +me rule comes first so that two +me instances are reported as such, not as a count.
    media_instances = sum(1 for profile in wanted if profile.media_extensions)
    if media_instances > 1:
        raise LayoutError(
            f"more than one +me instance on {model} ({media_instances} requested): a GPU has one set of "
            "media extensions, so at most one +me instance fits"
        )
    counts = Counter(profile.name for profile in wanted)
    for name, count in counts.items():
        limit = profiles[name].max_instances
        if count > limit:
            raise LayoutError(
                f"too many instances of {name} on {model}: {count} requested, at most {limit} fit on one GPU"
            )
    compute_total = sum(profile.compute_slices for profile in wanted)
    if compute_total > COMPUTE_SLICES:
        raise LayoutError(
            f"no room on {model}: compute slices exhausted ({compute_total} needed, a GPU has {COMPUTE_SLICES})"
        )
    memory_total = sum(profile.memory_slices for profile in wanted)
    if memory_total > MEMORY_SLICES:
        raise LayoutError(
            f"no room on {model}: memory slices exhausted ({memory_total} needed, a GPU has {MEMORY_SLICES})"
        )
    return wanted


def check_placement(model: str, placed: list[tuple[str, int]]) -> None:
    """Raise LayoutError unless `placed` (profile name, start) is a placement NVIDIA accepts."""
    profiles = profiles_for(model)
    _check_counts(model, profiles, (name for name, _ in placed))
    occupied: dict[int, tuple[str, int]] = {}
    for name, start in placed:
        profile = profiles[name]
        if start not in profile.starts:
            allowed = ", ".join(map(str, profile.starts))
            raise LayoutError(f"{name} cannot start at slot {start} on {model}; allowed starts: {allowed}")
        for slot in profile.slots(start):
            if slot in occupied:
                other_name, other_start = occupied[slot]
                raise LayoutError(
                    f"{name} at slot {start} overlaps {other_name} at slot {other_start} on {model} (memory slot {slot})"
                )
            occupied[slot] = (name, start)


def valid_placement(model: str, placed: list[tuple[str, int]]) -> bool:
    """True when `placed` is a placement NVIDIA accepts on one GPU of `model`."""
    try:
        check_placement(model, placed)
    except LayoutError:
        return False
    return True


def fit_layout(model: str, profile_names: list[str]) -> list[tuple[str, int]]:
    """A concrete placement (name, start), sorted by start, for the profiles on one GPU, or LayoutError."""
    profiles = profiles_for(model)
    wanted = _check_counts(model, profiles, profile_names)
    # Place the widest instances first: they have the fewest starts, so the search fails fast.
    order = sorted(wanted, key=lambda profile: (-profile.span, len(profile.starts), profile.name))
    occupied = [False] * MEMORY_SLICES
    chosen: list[tuple[str, int]] = []

    def place(index: int, lowest_start: int) -> bool:
        if index == len(order):
            return True
        profile = order[index]
        # Identical instances are interchangeable: trying only increasing starts for them
        # avoids searching the same placement in every order.
        same_as_previous = index > 0 and order[index - 1] is profile
        for start in profile.starts:
            if same_as_previous and start < lowest_start:
                continue
            slots = profile.slots(start)
            if any(occupied[slot] for slot in slots):
                continue
            for slot in slots:
                occupied[slot] = True
            chosen.append((profile.name, start))
            if place(index + 1, start + profile.span):
                return True
            chosen.pop()
            for slot in slots:
                occupied[slot] = False
        return False

    if not place(0, 0):
        requested = ", ".join(sorted(profile.name for profile in wanted))
        raise LayoutError(
            f"no room on {model}: no placement of [{requested}] fits NVIDIA's allowed start slots without overlap"
        )
    return sorted(chosen, key=lambda item: item[1])


def fits(model: str, profile_names: list[str]) -> bool:
    """True when the profiles can share one GPU of `model`."""
    try:
        fit_layout(model, profile_names)
    except LayoutError:
        return False
    return True


def free_starts(model: str, placed: list[tuple[str, int]], profile_name: str) -> list[int]:
    """The starts where one more `profile_name` fits beside `placed`, without moving anything."""
    profiles = profiles_for(model)
    _profile(profiles, model, profile_name)
    check_placement(model, placed)
    return [
        start
        for start in profiles[profile_name].starts
        if valid_placement(model, [*placed, (profile_name, start)])
    ]
