"""GPU Operator configs: rendered YAML parses back to exactly NVIDIA's documented structure."""

import re

import pytest
import yaml

from runners.nvidia.gpu_operator import (
    LayoutError,
    MigDeviceGroup,
    SharedResource,
    cluster_policy_patch,
    config_map,
    device_plugin_config_map_data,
    mig_parted_config,
    mig_parted_config_map_data,
    partition_node_labels,
    render_mig_parted_config,
    render_time_slicing_config,
    time_slicing_config,
)
from runners.nvidia.names import DEFAULT_MIG_PARTED_CONFIG_MAP

pytestmark = pytest.mark.unit

# NVIDIA/mig-parted examples/config.yaml, verbatim.
MIG_PARTED_EXAMPLE = """
version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false

  all-enabled:
    - devices: all
      mig-enabled: true
      mig-devices: {}

  all-1g.5gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "1g.5gb": 7

  all-2g.10gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "2g.10gb": 3

  all-3g.20gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "3g.20gb": 2

  all-balanced:
    - devices: all
      mig-enabled: true
      mig-devices:
        "1g.5gb": 2
        "2g.10gb": 1
        "3g.20gb": 1

  custom-config:
    - devices: [0,1,2,3]
      mig-enabled: false
    - devices: [4]
      mig-enabled: true
      mig-devices:
        "1g.5gb": 7
    - devices: [5]
      mig-enabled: true
      mig-devices:
        "2g.10gb": 3
    - devices: [6]
      mig-enabled: true
      mig-devices:
        "3g.20gb": 2
    - devices: [7]
      mig-enabled: true
      mig-devices:
        "1g.5gb": 2
        "2g.10gb": 1
        "3g.20gb": 1
"""

# GPU Operator, "Time-Slicing GPUs in Kubernetes": the cluster-wide and per-node examples.
TIME_SLICING_ALL_EXAMPLE = """
version: v1
flags:
  migStrategy: none
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""
TIME_SLICING_A100_EXAMPLE = """
version: v1
flags:
  migStrategy: mixed
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 8
    - name: nvidia.com/mig-1g.5gb
      replicas: 2
    - name: nvidia.com/mig-2g.10gb
      replicas: 2
    - name: nvidia.com/mig-3g.20gb
      replicas: 3
    - name: nvidia.com/mig-7g.40gb
      replicas: 7
"""
TIME_SLICING_RENAMED_EXAMPLE = """
version: v1
flags:
  migStrategy: none
sharing:
  timeSlicing:
    renameByDefault: true
    failRequestsGreaterThanOne: false
    resources:
    - name: nvidia.com/gpu
      replicas: 10
"""

BALANCED = ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]


def test_the_mig_parted_config_matches_nvidias_example_exactly():
    rendered = render_mig_parted_config(
        {
            "all-enabled": [],
            "all-1g.5gb": ["1g.5gb"] * 7,
            "all-2g.10gb": ["2g.10gb"] * 3,
            "all-3g.20gb": ["3g.20gb"] * 2,
            "all-balanced": BALANCED,
            "custom-config": [
                MigDeviceGroup(devices=(0, 1, 2, 3), mig_enabled=False),
                MigDeviceGroup(devices=(4,), profiles=("1g.5gb",) * 7),
                MigDeviceGroup(devices=(5,), profiles=("2g.10gb",) * 3),
                MigDeviceGroup(devices=(6,), profiles=("3g.20gb",) * 2),
                MigDeviceGroup(devices=(7,), profiles=tuple(BALANCED)),
            ],
        },
        gpu_model_name="A100-40GB",
    )
    assert yaml.safe_load(rendered) == yaml.safe_load(MIG_PARTED_EXAMPLE)


def test_the_mig_parted_config_always_offers_all_disabled_first():
    config = yaml.safe_load(render_mig_parted_config({"h100-4g-3g": ["3g.40gb", "4g.40gb"]}, gpu_model_name="H100-80GB"))
    assert list(config["mig-configs"]) == ["all-disabled", "h100-4g-3g"]
    assert config["mig-configs"]["all-disabled"] == [{"devices": "all", "mig-enabled": False}]
    # Counts follow NVIDIA's table order, so the file reads from small to large.
    assert config["mig-configs"]["h100-4g-3g"] == [
        {"devices": "all", "mig-enabled": True, "mig-devices": {"3g.40gb": 1, "4g.40gb": 1}}
    ]


def test_a_media_extension_profile_keeps_its_plus_in_the_mig_parted_config():
    config = mig_parted_config({"me": ["1g.10gb+me", "3g.40gb"]}, gpu_model_name="H100-80GB")
    assert config["mig-configs"]["me"][0]["mig-devices"] == {"1g.10gb+me": 1, "3g.40gb": 1}


def test_a_none_layout_disables_mig_on_every_gpu():
    config = mig_parted_config({"whole-gpus": None})
    assert config["mig-configs"]["whole-gpus"] == [{"devices": "all", "mig-enabled": False}]


def test_device_filters_are_passed_through():
    config = mig_parted_config({"h100-only": [MigDeviceGroup(device_filter=("0x233010DE",), profiles=("7g.80gb",))]})
    assert config["mig-configs"]["h100-only"] == [
        {"devices": "all", "device-filter": ["0x233010DE"], "mig-enabled": True, "mig-devices": {"7g.80gb": 1}}
    ]


@pytest.mark.parametrize(
    ("layouts", "message"),
    [
        ({"too-big": ["4g.40gb", "4g.40gb"]}, "mig-parted config 'too-big': too many instances of 4g.40gb"),
        ({"two-me": ["1g.10gb+me", "1g.10gb+me"]}, "mig-parted config 'two-me': more than one +me"),
        ({"typo": ["1g.5gb"]}, "mig-parted config 'typo': unknown MIG profile '1g.5gb' for H100-80GB"),
    ],
)
def test_it_rejects_a_mig_layout_that_cannot_exist_naming_the_config(layouts, message):
    with pytest.raises(LayoutError, match=re.escape(message)):
        render_mig_parted_config(layouts, gpu_model_name="H100-80GB")


@pytest.mark.parametrize(
    ("layouts", "message"),
    [
        ({"bad name!": ["1g.10gb"]}, "cannot be a node label value"),
        ({"all-disabled": ["1g.10gb"]}, "'all-disabled' is reserved"),
        ({"word": "1g.10gb"}, "give a list of profile names"),
        ({"off": [MigDeviceGroup(mig_enabled=False, profiles=("1g.10gb",))]}, "MIG devices on GPUs with MIG disabled"),
        ({"neg": [MigDeviceGroup(devices=(-1,), profiles=("1g.10gb",))]}, "devices must be 'all' or GPU indices"),
    ],
)
def test_it_rejects_malformed_mig_parted_input_naming_the_field(layouts, message):
    with pytest.raises(ValueError, match=message):
        mig_parted_config(layouts)


def test_it_rejects_a_mig_parted_config_for_a_gpu_without_mig():
    with pytest.raises(ValueError, match="'T4' does not support MIG"):
        mig_parted_config({"x": ["1g.10gb"]}, gpu_model_name="T4")


def test_the_time_slicing_config_matches_the_operators_cluster_wide_example():
    assert yaml.safe_load(render_time_slicing_config({"nvidia.com/gpu": 4})) == yaml.safe_load(TIME_SLICING_ALL_EXAMPLE)


def test_the_time_slicing_config_matches_the_operators_mixed_mig_example():
    rendered = render_time_slicing_config(
        {
            "nvidia.com/gpu": 8,
            "nvidia.com/mig-1g.5gb": 2,
            "nvidia.com/mig-2g.10gb": 2,
            "nvidia.com/mig-3g.20gb": 3,
            "nvidia.com/mig-7g.40gb": 7,
        },
        mig_strategy="mixed",
    )
    assert yaml.safe_load(rendered) == yaml.safe_load(TIME_SLICING_A100_EXAMPLE)


def test_rename_by_default_sits_under_time_slicing_as_documented():
    rendered = render_time_slicing_config(
        [SharedResource("nvidia.com/gpu", 10)], rename_by_default=True, fail_requests_greater_than_one=False
    )
    assert yaml.safe_load(rendered) == yaml.safe_load(TIME_SLICING_RENAMED_EXAMPLE)


def test_a_resource_can_be_renamed_on_its_own():
    config = time_slicing_config([SharedResource("nvidia.com/gpu", 2, rename="nvidia.com/gpu.half")])
    assert config["sharing"]["timeSlicing"]["resources"] == [
        {"name": "nvidia.com/gpu", "rename": "nvidia.com/gpu.half", "replicas": 2}
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"resources": {"nvidia.com/gpu": 1}}, "replicas must be an integer of at least 2"),
        ({"resources": {"nvidia.com/mig-1g.10gb": 2}}, "needs migStrategy 'mixed'"),
        ({"resources": {"nvidia.com/mig-1g.10gb+me": 2}, "mig_strategy": "mixed"}, "write \\+me as .me"),
        ({"resources": {"amd.com/gpu": 2}}, "'amd.com/gpu' is not a device plugin resource"),
        ({"resources": {}}, "at least one resource"),
        ({"resources": {"nvidia.com/gpu": 2}, "mig_strategy": "both"}, "migStrategy must be one of"),
        (
            {"resources": [SharedResource("nvidia.com/gpu", 2), SharedResource("nvidia.com/gpu", 4)]},
            "lists nvidia.com/gpu more than once",
        ),
    ],
)
def test_it_rejects_time_slicing_the_device_plugin_would_refuse(kwargs, message):
    with pytest.raises(ValueError, match=message):
        time_slicing_config(**kwargs)


def test_the_config_maps_use_the_keys_the_operator_reads():
    mig_data = mig_parted_config_map_data(mig_parted_config({"all-7g": ["7g.80gb"]}, gpu_model_name="H100-80GB"))
    assert list(mig_data) == ["config.yaml"]
    assert yaml.safe_load(mig_data["config.yaml"])["version"] == "v1"
    plugin_data = device_plugin_config_map_data({"any": time_slicing_config({"nvidia.com/gpu": 4})})
    assert yaml.safe_load(plugin_data["any"]) == yaml.safe_load(TIME_SLICING_ALL_EXAMPLE)
    manifest = config_map(DEFAULT_MIG_PARTED_CONFIG_MAP, mig_data)
    assert manifest == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "default-mig-parted-config", "namespace": "gpu-operator"},
        "data": mig_data,
    }


def test_the_cluster_policy_patch_names_our_config_maps():
    patch = cluster_policy_patch(
        device_plugin_config_map="portal-device-plugin",
        default_device_plugin_config="any",
        mig_parted_config_map="portal-mig-parted",
        default_mig_config="all-disabled",
        mig_strategy="mixed",
    )
    assert patch == {
        "spec": {
            "mig": {"strategy": "mixed"},
            "migManager": {"config": {"name": "portal-mig-parted", "default": "all-disabled"}},
            "devicePlugin": {"config": {"name": "portal-device-plugin", "default": "any"}},
        }
    }


def test_nodes_select_layouts_and_sharing_by_label():
    assert partition_node_labels(mig_config="all-1g.10gb", device_plugin_config="h100-mig-shared") == {
        "nvidia.com/mig.config": "all-1g.10gb",
        "nvidia.com/device-plugin.config": "h100-mig-shared",
    }
    with pytest.raises(ValueError, match="cannot be a node label value"):
        partition_node_labels(mig_config="1g.10gb+me")
