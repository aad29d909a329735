"""A Kubernetes node's cache agent reports its cache to the portal: only the agents' token is accepted, the
node must be one the portal knows, the report's shape is checked, and the node's rows become what it says."""

import pytest
from rest_framework.test import APIClient

from runners.clusters.models import Node
from runners.nodecache.models import CachedBlob, NodeCacheState

pytestmark = pytest.mark.integration

URL = "/api/v1/node-caches/report/"
TOKEN = "the-agents-token"
SHA = "ab" * 32


def _report(node: str, *, sha: str = SHA) -> dict:
    return {"node": node, "snapshot": {
        "stats": {"capacity_bytes": 10_000, "bytes_held": 4096, "blobs": 1, "pinned_bytes": 4096, "hits": 3,
                  "misses": 1, "bytes_pulled": 4096, "evictions": 0, "bytes_evicted": 0},
        "entries": [{"sha256": sha, "kind": "shards", "bytes": 4096, "state": "ready", "filled_at": 1.8e9,
                     "last_used": 1.8e9 + 5, "pins": ["vol-1"]}]}}


def _post(body, token: str | None = TOKEN):
    client = APIClient()
    if token is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client.post(URL, body, format="json")


def test_an_agents_report_brings_the_nodes_rows_to_its_cache(inventory, settings):
    settings.CACHE_AGENT_TOKEN = TOKEN
    node = Node.objects.order_by("name").first()
    answer = _post(_report(node.name))
    assert answer.status_code == 200, answer.content
    assert answer.json() == {"node": node.name, "added": 1, "removed": 0}
    assert list(CachedBlob.objects.filter(node=node).values_list("sha256", flat=True)) == [SHA]
    state = NodeCacheState.objects.get(node=node)
    assert (state.capacity_bytes, state.bytes_held, state.hits, state.misses) == (10_000, 4096, 3, 1)
    # The next report no longer holds it (evicted): its row goes.
    empty = _report(node.name)
    empty["snapshot"]["entries"] = []
    assert _post(empty).json() == {"node": node.name, "added": 0, "removed": 1}
    assert not CachedBlob.objects.filter(node=node).exists()


def test_a_report_without_the_agents_token_or_for_an_unknown_node_or_malformed_changes_nothing(inventory, settings,
                                                                                               client_for, staff):
    node = Node.objects.order_by("name").first()
    settings.CACHE_AGENT_TOKEN = ""
    assert _post(_report(node.name), token="").status_code == 401  # no token set: no agent is believed
    settings.CACHE_AGENT_TOKEN = TOKEN
    assert _post(_report(node.name), token=None).status_code == 401
    assert _post(_report(node.name), token="a-guess").status_code == 401
    # Not even staff's API token is an agent's.
    assert client_for(staff).post(URL, _report(node.name), format="json").status_code == 401
    unknown = _post(_report("no-such-node"))
    assert unknown.status_code == 400 and "node" in unknown.json()
    assert _post(_report(node.name, sha="not-a-hash")).status_code == 400
    assert not CachedBlob.objects.exists() and not NodeCacheState.objects.exists()
