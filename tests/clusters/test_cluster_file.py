"""The local backend's cluster file, and the openb trace's node list as an inventory."""

from pathlib import Path

import pytest

from runners.backends.cluster_file import ClusterFileError, load_cluster_file

pytestmark = pytest.mark.unit

OPENB_NODES = Path(__file__).resolve().parents[1] / "data" / "openb" / "openb_node_list_gpu_node.csv"


def test_the_demo_cluster_has_nvlink_h100s_a_mig_a100_and_time_sliced_t4s():
    nodes = {node.name: node for node in load_cluster_file(Path("runners/clusters/demo.yaml"))}
    assert nodes["h100-node-1"].nvlink_domain == "h100-node-1-nvswitch"
    assert nodes["a100-node-1"].gpus[0].partition_kind == "mig"
    assert nodes["t4-node-1"].gpu_resources == {"nvidia.com/gpu.shared": 16}


def test_the_openb_node_list_loads_as_an_inventory():
    nodes = load_cluster_file(OPENB_NODES)
    assert len(nodes) == 1213
    assert sum(len(node.gpus) for node in nodes) == 6212
    assert {node.pool for node in nodes} >= {"openb-v100m32", "openb-t4"}


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("racks: [{name: r, blocks: [{name: b, nodes: [{name: n, gpus: {model: Z80, count: 2}}]}]}]",
         "racks[0].blocks[0].nodes[0].gpus.model: unknown GPU model 'Z80'"),
        ("racks: [{name: r, blocks: [{name: b, nodes: [{name: n, cpu_milli: -5}]}]}]",
         "racks[0].blocks[0].nodes[0].cpu_milli: expected a whole number"),
        ("racks: [{name: r, blocks: [{name: b, nodes: [{name: n, gpus: {model: H100-80GB, count: 1}, "
         "partition: {kind: mig, layout: [4g.40gb, 4g.40gb]}}]}]}]",
         "racks[0].blocks[0].nodes[0].partition.layout"),
        ("racks: [{name: r, blocks: [{name: b, nodes: [{name: n}, {name: n}]}]}]", "repeated: n"),
        ("nodes: []", "expected a mapping with a 'racks' list"),
    ],
)
def test_a_malformed_cluster_file_names_the_place(tmp_path, text, phrase):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(ClusterFileError) as error:
        load_cluster_file(path)
    assert phrase in str(error.value)
