"""Watches on the stand-in, as the API server's watch cache serves them: the stream stays open and
sends events as they happen until timeoutSeconds, ends with a BOOKMARK when asked for bookmarks, and
a resourceVersion older than the cache's history is 410 Expired.
"""

import http.client
import json
from urllib.parse import urlsplit

import pytest

from tests.support.k8s import api_call
from tests.support.k8s_standin import KubernetesStandIn

pytestmark = pytest.mark.e2e

NS = "acme-train"
PODS = f"/api/v1/namespaces/{NS}/pods"


def make(api, name: str) -> str:
    status, pod = api_call(api, "POST", PODS, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                                               "spec": {"containers": [{"name": "c", "image": "i"}]}})
    assert status == 201, pod
    return pod["metadata"]["resourceVersion"]


@pytest.fixture
def standin():
    with KubernetesStandIn(watch_window_s=0.3) as api:
        api_call(api, "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        yield api


def open_watch(api, since: str, timeout_s: int):
    url = urlsplit(api.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    connection.request("GET", f"{PODS}?watch=true&resourceVersion={since}&timeoutSeconds={timeout_s}"
                              "&allowWatchBookmarks=true")
    return connection, connection.getresponse()


def test_a_watch_stays_open_and_sends_each_event_as_it_happens(standin):
    _status, listing = api_call(standin, "GET", PODS)
    connection, response = open_watch(standin, listing["metadata"]["resourceVersion"], timeout_s=5)
    try:
        assert response.status == 200
        make(standin, "first")
        event = json.loads(response.readline())
        assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "first")
        # Still the same stream: the second pod comes on it too.
        second_rv = make(standin, "second")
        event = json.loads(response.readline())
        assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "second")
        # At timeoutSeconds it ends, with a bookmark at the version reached.
        rest = [json.loads(line) for line in response.read().splitlines() if line.strip()]
        assert rest[-1]["type"] == "BOOKMARK"
        assert int(rest[-1]["object"]["metadata"]["resourceVersion"]) >= int(second_rv)
        assert rest[-1]["object"]["kind"] == "Pod"
    finally:
        connection.close()


def test_a_version_older_than_the_watch_cache_is_expired():
    # The cache's history is dated by a clock the test moves, so which events fall out of the window
    # does not hang on how fast a loaded machine runs the test.
    now = [0.0]
    with KubernetesStandIn(watch_window_s=0.3, history_clock=lambda: now[0]) as api:
        api_call(api, "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        old = make(api, "first")
        now[0] += 0.4  # past the 0.3 s history: the namespace and "first" fall out of it
        make(api, "second")
        status, answer = api_call(api, "GET", f"{PODS}?watch=true&resourceVersion={int(old) - 1}&timeoutSeconds=1")
        assert status == 200
        assert answer["type"] == "ERROR" and answer["object"]["code"] == 410
        assert answer["object"]["reason"] == "Expired"
        # The version of the last forgotten event still watches, and gets what came after it.
        status, stream = api_call(api, "GET", f"{PODS}?watch=true&resourceVersion={old}&timeoutSeconds=1")
        assert status == 200
        events = [json.loads(line) for line in stream.splitlines()] if isinstance(stream, str) else [stream]
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "second")]
