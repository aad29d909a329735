"""The GPU catalog: models, and the Kubernetes resource names and node labels of each flavor kind."""

import pytest

from runners.nvidia import catalog, mig
from runners.nvidia.catalog import (
    FlavorKind,
    mig_flavor,
    model_for_product_label,
    time_sliced_flavor,
    whole_gpu_flavor,
)
from runners.nvidia.mig import LayoutError, MigNotSupportedError, UnknownGpuModelError

pytestmark = pytest.mark.unit


def test_the_catalog_builds_on_the_geometry_without_re_exporting_it():
    assert "fit_layout" not in catalog.__all__ and "GPU_MODELS" not in catalog.__all__
    assert mig.profiles_for("H200-141GB")["7g.141gb"].span == 8


@pytest.mark.parametrize(
    ("model", "product_label"),
    [
        ("A100-40GB", "NVIDIA-A100-SXM4-40GB"),
        ("A100-80GB", "NVIDIA-A100-SXM4-80GB"),
        ("H100-80GB", "NVIDIA-H100-80GB-HBM3"),
        ("H200-141GB", "NVIDIA-H200"),
        ("L4", "NVIDIA-L4"),
        ("T4", "Tesla-T4"),
        ("A10", "NVIDIA-A10"),
    ],
)
def test_a_whole_gpu_is_nvidia_com_gpu_on_nodes_labelled_with_its_product(model, product_label):
    flavor = whole_gpu_flavor(model)
    assert flavor.kind is FlavorKind.WHOLE_GPU
    assert flavor.kubernetes_resource == "nvidia.com/gpu"
    assert dict(flavor.node_labels) == {"nvidia.com/gpu.product": product_label}
    assert flavor.product_labels[0] == product_label
    assert flavor.gpu_milli == 1000


def test_a_mig_slice_is_its_own_resource_under_the_mixed_strategy():
    flavor = mig_flavor("H100-80GB", "3g.40gb")
    assert flavor.kind is FlavorKind.MIG
    assert flavor.name == "h100-80gb-mig-3g.40gb"
    assert flavor.kubernetes_resource == "nvidia.com/mig-3g.40gb"
    assert dict(flavor.node_labels) == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/mig.strategy": "mixed"}
    assert flavor.gpu_milli == 3 * 1000 // 7
    assert flavor.mig_profile == "3g.40gb"


def test_a_media_extension_slice_gets_a_dotted_resource_and_flavor_name():
    flavor = mig_flavor("A100-40GB", "1g.5gb+me")
    assert flavor.kubernetes_resource == "nvidia.com/mig-1g.5gb.me"
    assert flavor.name == "a100-40gb-mig-1g.5gb.me"


def test_a_time_sliced_replica_keeps_the_resource_and_marks_the_product_shared():
    flavor = time_sliced_flavor("T4", 4)
    assert flavor.kind is FlavorKind.TIME_SLICED
    assert flavor.kubernetes_resource == "nvidia.com/gpu"
    assert dict(flavor.node_labels) == {"nvidia.com/gpu.product": "Tesla-T4-SHARED", "nvidia.com/gpu.replicas": "4"}
    assert (flavor.gpu_milli, flavor.replicas, flavor.name) == (250, 4, "t4-shared-4")


def test_a_renamed_time_sliced_replica_is_gpu_shared_with_the_plain_product_label():
    flavor = time_sliced_flavor("L4", 2, rename_by_default=True)
    assert flavor.kubernetes_resource == "nvidia.com/gpu.shared"
    assert flavor.node_labels["nvidia.com/gpu.product"] == "NVIDIA-L4"


@pytest.mark.parametrize("replicas", [0, 1, -3, 2.5, True])
def test_it_rejects_a_replica_count_that_shares_nothing(replicas):
    with pytest.raises(ValueError, match="replicas must be an integer of at least 2"):
        time_sliced_flavor("T4", replicas)


def test_it_rejects_mig_flavors_for_unknown_profiles_and_non_mig_models():
    with pytest.raises(LayoutError, match="unknown MIG profile '1g.5gb' for H100-80GB"):
        mig_flavor("H100-80GB", "1g.5gb")
    with pytest.raises(MigNotSupportedError, match="'A10' does not support MIG"):
        mig_flavor("A10", "1g.10gb")
    with pytest.raises(UnknownGpuModelError, match="unknown GPU model 'B300'"):
        whole_gpu_flavor("B300")


@pytest.mark.parametrize(
    ("label", "model"),
    [
        ("NVIDIA-H100-80GB-HBM3", "H100-80GB"),
        ("Tesla-T4-SHARED", "T4"),
        ("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", "A100-40GB"),
        ("NVIDIA-A100-80GB-PCIe", "A100-80GB"),
        ("A100-SXM4-40GB", "A100-40GB"),
    ],
)
def test_it_finds_the_model_behind_a_gfd_product_label(label, model):
    assert model_for_product_label(label).name == model


def test_it_names_an_unknown_product_label():
    with pytest.raises(UnknownGpuModelError, match="'NVIDIA-B200'"):
        model_for_product_label("NVIDIA-B200")


def test_every_flavor_name_is_a_valid_kubernetes_name():
    for model, entry in mig.GPU_MODELS.items():
        names = [whole_gpu_flavor(model).name, time_sliced_flavor(model, 8).name]
        names += [mig_flavor(model, profile).name for profile in entry.profiles]
        for name in names:
            assert name == name.lower() and len(name) <= 63 and "+" not in name, name
