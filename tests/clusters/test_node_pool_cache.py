"""A node pool's cache setting: staff set where each node keeps its cache of shards and weights and its
size; the next launch on the pool's nodes is handed them; bad input is a 400 naming the field."""

import pytest

from audit.models import AuditEntry
from runners.clusters.models import Node, NodePool
from runners.clusters.selectors import node_cache_specs

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


def test_staff_set_a_pools_cache_and_the_launch_on_its_nodes_gets_it(inventory, staff, client_for):
    pool = NodePool.objects.filter(nodes__isnull=False).distinct().first()
    nodes = sorted(pool.nodes.values_list("name", flat=True))
    assert node_cache_specs(nodes) == ()  # nothing set: the backend's defaults

    answer = client_for(staff).put(f"/api/v1/node-pools/{pool.id}/cache/",
                                   {"cache_path": "/mnt/nvme/portal-cache", "cache_bytes": 2 * 10**12}, format="json")
    assert answer.status_code == 200, answer.content
    assert (answer.json()["cache_path"], answer.json()["cache_bytes"]) == ("/mnt/nvme/portal-cache", 2 * 10**12)
    specs = node_cache_specs(nodes)
    assert [(spec.node, spec.path, spec.capacity_bytes) for spec in specs] == [
        (node, "/mnt/nvme/portal-cache", 2 * 10**12) for node in nodes]
    entry = AuditEntry.objects.get(action="node_pool.cache_changed")
    assert entry.before == {"cache_path": "", "cache_bytes": 0}
    assert entry.after == {"cache_path": "/mnt/nvme/portal-cache", "cache_bytes": 2 * 10**12}

    # Blank and 0 go back to the defaults.
    assert client_for(staff).put(f"/api/v1/node-pools/{pool.id}/cache/", {"cache_path": "", "cache_bytes": 0},
                                 format="json").status_code == 200
    assert node_cache_specs(nodes) == ()


@pytest.mark.parametrize("body, field", [
    ({"cache_path": "relative/cache", "cache_bytes": 1}, "cache_path"),
    ({"cache_path": "/mnt/../etc", "cache_bytes": 1}, "cache_path"),
    ({"cache_path": "/mnt/cache", "cache_bytes": -1}, "cache_bytes"),
    ({"cache_path": "/mnt/cache", "cache_bytes": 10**16}, "cache_bytes"),
    ({"cache_path": "/mnt/cache", "cache_bytes": "lots"}, "cache_bytes"),
    ({"cache_bytes": 1}, "cache_path"),
])
def test_bad_input_is_a_400_naming_the_field_and_changes_nothing(inventory, staff, client_for, body, field):
    pool = NodePool.objects.filter(nodes__isnull=False).first()
    answer = client_for(staff).put(f"/api/v1/node-pools/{pool.id}/cache/", body, format="json")
    assert answer.status_code == 400 and field in answer.json(), answer.content
    pool.refresh_from_db()
    assert (pool.cache_path, pool.cache_bytes) == ("", 0)


def test_only_staff_may_set_it(inventory, owner, client_for):
    pool = NodePool.objects.filter(nodes__isnull=False).first()
    answer = client_for(owner).put(f"/api/v1/node-pools/{pool.id}/cache/", {"cache_path": "/x", "cache_bytes": 1},
                                   format="json")
    assert answer.status_code in (403, 404)
    assert not NodePool.objects.exclude(cache_path="").exists() and Node.objects.exists()
