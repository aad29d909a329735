"""The portal's view of the node caches: the sync brings CachedBlob and NodeCacheState rows to each cache's
snapshot (fills added, evictions removed), `bytes_held` answers placement, and the figures reach the API
(staff only), ``/metrics`` and the cockpit."""

import uuid

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from runners.clusters.models import Node, NodePool
from runners.nodecache import selectors, services
from runners.nodecache.models import CachedBlob, NodeCacheState
from runners.storage.blobs import BlobStore
from runners.storage.nodecache import BlobWanted, NodeCache
from tests.conftest import PASSWORD

pytestmark = pytest.mark.integration


@pytest.fixture
def store(settings, tmp_path):
    settings.DATA_STORAGE_URL = f"file://{tmp_path / 'blobstore'}"
    return BlobStore(settings.DATA_STORAGE_URL, "shards")


def put(store, size=1000) -> BlobWanted:
    sha, stored = store.put_bytes((uuid.uuid4().bytes * (size // 16 + 1))[:size])
    return BlobWanted(sha, stored)


def test_the_sync_records_fills_and_evictions_and_bytes_held_reads_them(inventory, store, tmp_path):
    node = Node.objects.order_by("name").first()
    cache = NodeCache(tmp_path / "node-cache" / node.name, 2500)
    first, second, third = put(store), put(store), put(store)
    cache.fill(store, first, holder="job-1-attempt-1")
    cache.fill(store, second, holder="job-1-attempt-1")
    cache.fill(store, first, holder="job-2-attempt-1")  # a hit
    assert services.caches_sync() == {"nodes": 1, "added": 2, "removed": 0}
    assert set(CachedBlob.objects.filter(node=node).values_list("sha256", flat=True)) == {first.sha256, second.sha256}
    state = NodeCacheState.objects.get(node=node)
    assert (state.bytes_held, state.hits, state.misses, state.bytes_pulled) == (2000, 1, 2, 2000)
    other = Node.objects.exclude(id=node.id).first()
    assert selectors.bytes_held([node.name, other.name], [first.sha256, third.sha256]) == {
        node.name: 1000, other.name: 0}

    cache.release("job-1-attempt-1")
    cache.release("job-2-attempt-1")
    cache.fill(store, third, holder="job-3-attempt-1")  # evicts the least recently used: second
    assert services.caches_sync() == {"nodes": 1, "added": 1, "removed": 1}
    assert set(CachedBlob.objects.filter(node=node).values_list("sha256", flat=True)) == {first.sha256, third.sha256}
    assert NodeCacheState.objects.get(node=node).evictions == 1


def test_a_pools_cache_path_and_size_are_the_ones_synced(inventory, store, tmp_path):
    node = Node.objects.filter(pool__isnull=False).order_by("name").first()
    NodePool.objects.filter(id=node.pool_id).update(cache_path=str(tmp_path / "nvme"), cache_bytes=5000)
    NodeCache(tmp_path / "nvme" / node.name, 5000).fill(store, put(store), holder="job-1-attempt-1")
    services.caches_sync()
    assert NodeCacheState.objects.get(node=node).capacity_bytes == 5000


def test_staff_read_the_caches_and_a_tenant_reads_nothing(inventory, store, tmp_path, client_for, staff, owner):
    node = Node.objects.order_by("name").first()
    NodeCache(tmp_path / "node-cache" / node.name, 10_000).fill(store, put(store), holder="job-1-attempt-1")
    services.caches_sync()
    listed = client_for(staff).get("/api/v1/node-caches/").json()
    rows = listed["results"] if isinstance(listed, dict) else listed
    assert [(row["node"], row["bytes_held"], row["hit_rate"]) for row in rows] == [(node.name, 1000, 0.0)]
    state = NodeCacheState.objects.get(node=node)
    assert client_for(owner).get(f"/api/v1/node-caches/{state.id}/").status_code == 404
    outsider_list = client_for(owner).get("/api/v1/node-caches/").json()
    assert (outsider_list["results"] if isinstance(outsider_list, dict) else outsider_list) == []


def test_the_figures_are_on_metrics_and_the_cockpit(inventory, store, tmp_path, client_for, staff):
    node = Node.objects.order_by("name").first()
    cache = NodeCache(tmp_path / "node-cache" / node.name, 10_000)
    blob = put(store)
    cache.fill(store, blob, holder="job-1-attempt-1")
    cache.fill(store, blob, holder="job-2-attempt-1")
    services.caches_sync()
    scraped = client_for(staff).get("/metrics")
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(scraped.content.decode()) for sample in family.samples}
    assert samples[("portal_node_cache_bytes", (("node", node.name),))] == 1000
    assert samples[("portal_node_cache_hits_total", (("node", node.name),))] == 1
    assert samples[("portal_node_cache_pulled_bytes_total", (("node", node.name),))] == 1000
    browser = Client()
    assert browser.login(username=staff.username, password=PASSWORD)
    page = browser.get("/cockpit/live/").content.decode()
    assert f'data-node="{node.name}"' in page and "50%" in page
