"""An inventory sync writes what the backend reports in a fixed number of statements, whatever the cluster's size."""

import pytest

from runners.backends.base import GpuInfo, NodeInfo
from runners.clusters.models import Gpu, Node, NodePool
from runners.clusters.services import inventory_sync

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


def _cluster(nodes: int, gpus: int, *, model="H100-80GB", memory_mib=81920, pool="h100-pool"):
    return [
        NodeInfo(name=f"node-{n}", cpu_milli=96000, memory_mib=1048576, pool=pool, rack=f"rack-{n % 4}",
                 gpus=tuple(GpuInfo(index=i, model=model, memory_mib=memory_mib, uuid=f"GPU-{n}-{i}")
                            for i in range(gpus)))
        for n in range(nodes)
    ]


def _statements(django_assert_max_num_queries, nodes):
    with django_assert_max_num_queries(30) as captured:
        inventory_sync(nodes=nodes)
    return len(captured.captured_queries)


def test_the_statements_do_not_grow_with_the_cluster(django_assert_max_num_queries):
    small = _statements(django_assert_max_num_queries, _cluster(2, 2))
    Node.objects.all().delete()
    NodePool.objects.all().delete()
    large = _statements(django_assert_max_num_queries, _cluster(200, 8))
    assert large == small
    assert Node.objects.count() == 200 and Gpu.objects.count() == 1600


def test_a_resync_updates_in_place_adds_and_removes():
    inventory_sync(nodes=_cluster(3, 4))
    ids = dict(Node.objects.values_list("name", "id"))
    gpu_ids = set(Gpu.objects.filter(node__name="node-0").values_list("id", flat=True))

    # node-0 loses two GPUs and changes model; node-2 is gone; node-3 is new; node-1 is named twice (the last wins).
    changed = _cluster(4, 4, model="A100-40GB", memory_mib=40960)
    changed[0] = NodeInfo(name="node-0", cpu_milli=1000, memory_mib=2048, pool="h100-pool",
                          gpus=tuple(GpuInfo(index=i, model="A100-40GB", memory_mib=40960) for i in range(2)))
    twice = NodeInfo(name="node-1", cpu_milli=5000, memory_mib=4096, pool="h100-pool", schedulable=False)
    result = inventory_sync(nodes=[changed[0], changed[1], twice, changed[3]])

    assert result == {"nodes": 3, "pools": 1, "removed": 1}
    assert set(Node.objects.values_list("name", flat=True)) == {"node-0", "node-1", "node-3"}
    node0 = Node.objects.get(name="node-0")
    assert node0.id == ids["node-0"] and (node0.cpu_milli, node0.memory_mib) == (1000, 2048)
    assert list(node0.gpus.order_by("index").values_list("index", "model")) == [(0, "A100-40GB"), (1, "A100-40GB")]
    assert set(node0.gpus.values_list("id", flat=True)) < gpu_ids  # the kept GPUs are the same rows
    node1 = Node.objects.get(name="node-1")
    assert node1.id == ids["node-1"] and not node1.schedulable and node1.gpus.count() == 0
    assert Node.objects.get(name="node-3").gpus.count() == 4
