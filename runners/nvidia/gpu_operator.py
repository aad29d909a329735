"""Render the NVIDIA GPU Operator's partition configs: mig-parted layouts and device plugin time-slicing.

Pure functions: each `*_config` returns plain dicts in exactly the documented structure,
`to_yaml` turns them into text, and the `render_*` helpers do both. The Kubernetes backend
puts the text into ConfigMaps and labels nodes; nothing here talks to a cluster.

How the GPU Operator consumes them:
* MIG Manager reads a mig-parted config (NVIDIA/mig-parted `examples/config.yaml`:
  `version: v1`, `mig-configs: {<name>: [{devices, mig-enabled, mig-devices}]}`) from the
  ConfigMap named in ClusterPolicy `spec.migManager.config.name` (the operator ships
  `default-mig-parted-config`), key `config.yaml`. Labelling a node
  `nvidia.com/mig.config=<name>` applies that layout; MIG Manager reports progress in
  `nvidia.com/mig.config.state` (`pending`, `rebooting`, `success`, `failed`).
* The device plugin reads its config from the ConfigMap named in ClusterPolicy
  `spec.devicePlugin.config.name`. Each key is one config; a node labelled
  `nvidia.com/device-plugin.config=<key>` uses that key, others use
  `spec.devicePlugin.config.default`.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

import yaml

from runners.nvidia.mig import LayoutError, fit_layout, gpu_model, profiles_for
from runners.nvidia.names import (
    DEVICE_PLUGIN_CONFIG_LABEL,
    GPU_OPERATOR_NAMESPACE,
    GPU_RESOURCE,
    MIG,
    MIG_ALL_DISABLED,
    MIG_CONFIG_LABEL,
    MIG_CONFIG_STATE_LABEL,
    MIG_PARTED_CONFIG_KEY,
    MIG_RESOURCE_PREFIX,
    TIMESLICE,
)

__all__ = [
    "MigDeviceGroup",
    "NodePartitionRequest",
    "SharedResource",
    "cluster_policy_patch",
    "config_map",
    "device_plugin_config_map_data",
    "mig_parted_config",
    "mig_parted_config_map_data",
    "node_partition_request",
    "partition_node_labels",
    "render_mig_parted_config",
    "render_time_slicing_config",
    "time_slicing_config",
    "to_yaml",
]

CONFIG_VERSION = "v1"
MIG_STRATEGIES = ("none", "single", "mixed")

# Config names become label values (`nvidia.com/mig.config=<name>`): at most 63 characters,
# alphanumerics with `-`, `_` and `.` inside.
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
# The name part of an extended resource is a DNS-1123 subdomain; the device plugin checks it.
_RESOURCE_NAME = re.compile(r"^nvidia\.com/[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class MigDeviceGroup:
    """One entry of a mig-parted config: which GPUs, and the MIG devices each of them gets."""

    devices: Literal["all"] | tuple[int, ...] = "all"
    mig_enabled: bool = True
    # NVIDIA profile names, one per instance on each selected GPU: ("3g.40gb", "1g.10gb", ...).
    profiles: tuple[str, ...] = ()
    # mig-parted's optional `device-filter`: PCI device IDs such as "0x233010DE".
    device_filter: tuple[str, ...] = ()


@dataclass(frozen=True)
class SharedResource:
    """One `sharing.timeSlicing.resources` entry: a resource and how many replicas each device becomes."""

    name: str
    replicas: int
    rename: str | None = None


def to_yaml(document: Mapping) -> str:
    """YAML text for a config dict, keys in the documented order."""
    return yaml.safe_dump(dict(document), sort_keys=False, default_flow_style=False)


def _check_label_value(kind: str, value: str) -> None:
    if not isinstance(value, str) or not _LABEL_VALUE.match(value):
        raise ValueError(
            f"{kind} {value!r} cannot be a node label value: use at most 63 letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )


def _mig_devices(profiles: Sequence[str], model: str | None) -> dict[str, int]:
    """Count instances per profile, in the model's table order when the model is known."""
    counts = Counter(profiles)
    order = list(profiles_for(model)) if model else sorted(counts)
    return {name: counts[name] for name in order if name in counts}


def _group_entry(layout_name: str, group: MigDeviceGroup, model: str | None) -> dict:
    devices = group.devices
    if devices != "all":
        if isinstance(devices, (str, bytes)) or not devices or not all(
            isinstance(index, int) and not isinstance(index, bool) and index >= 0 for index in devices
        ):
            raise ValueError(f"mig-parted config {layout_name!r}: devices must be 'all' or GPU indices, got {devices!r}")
        devices = list(devices)
    entry: dict = {"devices": devices}
    if group.device_filter:
        entry["device-filter"] = list(group.device_filter)
    entry["mig-enabled"] = group.mig_enabled
    if not group.mig_enabled:
        if group.profiles:
            raise ValueError(f"mig-parted config {layout_name!r} lists MIG devices on GPUs with MIG disabled")
        return entry
    if model:
        try:
            fit_layout(model, list(group.profiles))
        except LayoutError as error:
            raise LayoutError(f"mig-parted config {layout_name!r}: {error}") from None
    entry["mig-devices"] = _mig_devices(group.profiles, model)
    return entry


def mig_parted_config(
    layouts: Mapping[str, Sequence[str] | Sequence[MigDeviceGroup] | None], *, gpu_model_name: str | None = None
) -> dict:
    """A mig-parted config (`version: v1`, `mig-configs:`), always with an `all-disabled` entry.

    Each layout is either a list of profile names that every GPU gets (`devices: all`), a list
    of MigDeviceGroup for per-GPU layouts, or None for MIG disabled on all GPUs. With
    `gpu_model_name`, every GPU's layout is checked against NVIDIA's placement rules.
    """
    if gpu_model_name:
        gpu_model(gpu_model_name)
        profiles_for(gpu_model_name)
    configs: dict[str, list[dict]] = {MIG_ALL_DISABLED: [{"devices": "all", "mig-enabled": False}]}
    for name, layout in layouts.items():
        _check_label_value("mig-parted config name", name)
        if layout is None:
            groups = [MigDeviceGroup(mig_enabled=False)]
        elif isinstance(layout, str):
            raise ValueError(f"mig-parted config {name!r}: give a list of profile names, not the string {layout!r}")
        elif all(isinstance(item, MigDeviceGroup) for item in layout) and layout:
            groups = list(layout)
        elif all(isinstance(item, str) for item in layout):
            groups = [MigDeviceGroup(devices="all", mig_enabled=True, profiles=tuple(layout))]
        else:
            raise ValueError(f"mig-parted config {name!r}: mix of profile names and device groups; use one or the other")
        entries = [_group_entry(name, group, gpu_model_name) for group in groups]
        if name == MIG_ALL_DISABLED and entries != configs[MIG_ALL_DISABLED]:
            raise ValueError(f"{MIG_ALL_DISABLED!r} is reserved for MIG disabled on all GPUs; choose another name")
        configs[name] = entries
    return {"version": CONFIG_VERSION, "mig-configs": configs}


def render_mig_parted_config(
    layouts: Mapping[str, Sequence[str] | Sequence[MigDeviceGroup] | None], *, gpu_model_name: str | None = None
) -> str:
    """The mig-parted config as YAML text, ready for the ConfigMap key `config.yaml`."""
    return to_yaml(mig_parted_config(layouts, gpu_model_name=gpu_model_name))


def _shared_resource(item: SharedResource) -> dict:
    if not _RESOURCE_NAME.match(item.name):
        raise ValueError(
            f"time-slicing resource {item.name!r} is not a device plugin resource such as 'nvidia.com/gpu' "
            "or 'nvidia.com/mig-1g.10gb' (write +me as .me)"
        )
    if isinstance(item.replicas, bool) or not isinstance(item.replicas, int) or item.replicas < 2:
        raise ValueError(f"time-slicing resource {item.name!r}: replicas must be an integer of at least 2, got {item.replicas!r}")
    entry: dict = {"name": item.name}
    if item.rename is not None:
        if not _RESOURCE_NAME.match(item.rename):
            raise ValueError(f"time-slicing resource {item.name!r}: rename {item.rename!r} is not a valid nvidia.com resource name")
        entry["rename"] = item.rename
    entry["replicas"] = item.replicas
    return entry


def time_slicing_config(
    resources: Mapping[str, int] | Sequence[SharedResource],
    *,
    mig_strategy: str = "none",
    rename_by_default: bool | None = None,
    fail_requests_greater_than_one: bool | None = None,
) -> dict:
    """A device plugin config (`version: v1`) that time-slices the given resources.

    `resources` maps a resource name to its replicas, or lists SharedResource entries.
    `rename_by_default` and `fail_requests_greater_than_one` are written only when given,
    so that the plugin's defaults (both false) apply otherwise.
    """
    if mig_strategy not in MIG_STRATEGIES:
        raise ValueError(f"migStrategy must be one of {', '.join(MIG_STRATEGIES)}, got {mig_strategy!r}")
    items = (
        [SharedResource(name=name, replicas=replicas) for name, replicas in resources.items()]
        if isinstance(resources, Mapping)
        else list(resources)
    )
    if not items:
        raise ValueError("time-slicing needs at least one resource; the device plugin rejects an empty list")
    names = [item.name for item in items]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"time-slicing lists {', '.join(duplicates)} more than once")
    mig_resources = [name for name in names if name.startswith(MIG_RESOURCE_PREFIX)]
    if mig_resources and mig_strategy != "mixed":
        raise ValueError(
            f"time-slicing {', '.join(mig_resources)} needs migStrategy 'mixed': only then does the device plugin "
            "advertise MIG devices under their own resource names"
        )
    time_slicing: dict = {}
    if rename_by_default is not None:
        time_slicing["renameByDefault"] = bool(rename_by_default)
    if fail_requests_greater_than_one is not None:
        time_slicing["failRequestsGreaterThanOne"] = bool(fail_requests_greater_than_one)
    time_slicing["resources"] = [_shared_resource(item) for item in items]
    return {"version": CONFIG_VERSION, "flags": {"migStrategy": mig_strategy}, "sharing": {"timeSlicing": time_slicing}}


def render_time_slicing_config(
    resources: Mapping[str, int] | Sequence[SharedResource],
    *,
    mig_strategy: str = "none",
    rename_by_default: bool | None = None,
    fail_requests_greater_than_one: bool | None = None,
) -> str:
    """The device plugin's time-slicing config as YAML text, one value of its ConfigMap."""
    return to_yaml(
        time_slicing_config(
            resources,
            mig_strategy=mig_strategy,
            rename_by_default=rename_by_default,
            fail_requests_greater_than_one=fail_requests_greater_than_one,
        )
    )


def mig_parted_config_map_data(config: Mapping) -> dict[str, str]:
    """The `data` of MIG Manager's ConfigMap: the whole mig-parted config under `config.yaml`."""
    return {MIG_PARTED_CONFIG_KEY: to_yaml(config)}


def device_plugin_config_map_data(configs: Mapping[str, Mapping]) -> dict[str, str]:
    """The `data` of the device plugin's ConfigMap: one key per config, selected by node label."""
    data = {}
    for key, config in configs.items():
        _check_label_value("device plugin config key", key)
        data[key] = to_yaml(config)
    return data


def config_map(name: str, data: Mapping[str, str], *, namespace: str = GPU_OPERATOR_NAMESPACE) -> dict:
    """A v1 ConfigMap manifest holding one of these configs."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace}, "data": dict(data)}


def cluster_policy_patch(
    *,
    device_plugin_config_map: str | None = None,
    default_device_plugin_config: str | None = None,
    mig_parted_config_map: str | None = None,
    default_mig_config: str | None = None,
    mig_strategy: str | None = None,
) -> dict:
    """A merge patch for the ClusterPolicy that points the operator at our ConfigMaps."""
    spec: dict = {}
    if mig_strategy is not None:
        if mig_strategy not in ("single", "mixed"):
            raise ValueError(f"ClusterPolicy mig.strategy must be 'single' or 'mixed', got {mig_strategy!r}")
        spec["mig"] = {"strategy": mig_strategy}
    if mig_parted_config_map is not None or default_mig_config is not None:
        mig_config: dict = {}
        if mig_parted_config_map is not None:
            mig_config["name"] = mig_parted_config_map
        if default_mig_config is not None:
            _check_label_value("default mig-parted config", default_mig_config)
            mig_config["default"] = default_mig_config
        spec["migManager"] = {"config": mig_config}
    if device_plugin_config_map is not None or default_device_plugin_config is not None:
        plugin_config: dict = {}
        if device_plugin_config_map is not None:
            plugin_config["name"] = device_plugin_config_map
        if default_device_plugin_config is not None:
            _check_label_value("default device plugin config", default_device_plugin_config)
            plugin_config["default"] = default_device_plugin_config
        spec["devicePlugin"] = {"config": plugin_config}
    return {"spec": spec}


def partition_node_labels(*, mig_config: str | None = None, device_plugin_config: str | None = None) -> dict[str, str]:
    """The node labels that select a mig-parted layout and a device plugin config."""
    labels = {}
    if mig_config is not None:
        _check_label_value("mig-parted config name", mig_config)
        labels[MIG_CONFIG_LABEL] = mig_config
    if device_plugin_config is not None:
        _check_label_value("device plugin config key", device_plugin_config)
        labels[DEVICE_PLUGIN_CONFIG_LABEL] = device_plugin_config
    return labels


# --- Applying one partition profile to a node -------------------------------------


@dataclass(frozen=True)
class NodePartitionRequest:
    """Everything applying one partition profile to a node writes: its one rendering.

    The partition page's preview shows this and the Kubernetes backend applies
    exactly this, so what staff read before an apply is what the cluster gets.
    """

    name: str
    # Labels to merge-patch onto the node; None removes a label.
    node_labels: Mapping[str, str | None]
    # The profile's entry for MIG Manager's mig-parted config (merged with the entries already
    # there); None when the profile is not MIG.
    mig_parted_entry: Mapping[str, list] | None
    # The device plugin config stored under the key `name` of its ConfigMap (time-slicing only).
    device_plugin_config: str | None

    def mig_parted_config_text(self, existing_yaml: str | None = None) -> str | None:
        """The whole mig-parted config.yaml with this entry added or replaced, the others kept."""
        if self.mig_parted_entry is None:
            return None
        existing = yaml.safe_load(existing_yaml) if existing_yaml else None
        configs = dict((existing or {}).get("mig-configs") or {})
        configs.setdefault(MIG_ALL_DISABLED, [{"devices": "all", "mig-enabled": False}])
        configs.update(self.mig_parted_entry)
        return to_yaml({"version": CONFIG_VERSION, "mig-configs": configs})


def node_partition_request(
    *, name: str, kind: str, gpu_model_name: str, layout: Sequence[str] = (), replicas: int = 1
) -> NodePartitionRequest:
    """What the GPU Operator must be told to cut a node's GPUs as the profile says.

    MIG selects the profile's mig-parted entry and clears any time-slicing config;
    time-slicing disables MIG and selects the profile's device plugin key; whole
    GPUs disable MIG and clear time-slicing. MIG Manager's last answer is always
    removed, so only its answer to this request counts as done.
    """
    _check_label_value("partition profile name", name)
    labels: dict[str, str | None] = {MIG_CONFIG_STATE_LABEL: None}
    mig_entry = None
    plugin_config = None
    if kind == MIG:
        labels[MIG_CONFIG_LABEL] = name
        labels[DEVICE_PLUGIN_CONFIG_LABEL] = None
        mig_entry = {name: mig_parted_config({name: list(layout)}, gpu_model_name=gpu_model_name)["mig-configs"][name]}
    elif kind == TIMESLICE:
        labels[MIG_CONFIG_LABEL] = MIG_ALL_DISABLED
        labels[DEVICE_PLUGIN_CONFIG_LABEL] = name
        plugin_config = render_time_slicing_config({GPU_RESOURCE: replicas}, rename_by_default=True)
    else:
        labels[MIG_CONFIG_LABEL] = MIG_ALL_DISABLED
        labels[DEVICE_PLUGIN_CONFIG_LABEL] = None
    return NodePartitionRequest(
        name=name, node_labels=labels, mig_parted_entry=mig_entry, device_plugin_config=plugin_config
    )
