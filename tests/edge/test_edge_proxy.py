"""The edge's proxy core against a small upstream: a stream the client drops halfway closes the upstream
connection at once, a stream past its deadline is cut by the edge, and every other path (HTTP and
WebSocket) passes through to the web process behind the edge, as an interactive workspace will."""

import json
import time

import httpx
import pytest
from websockets.sync.client import connect

from runners.inference.models import Replica
from tests.edge.conftest import SETTLE_S, token_for
from tests.edge.upstream import Upstream
from tests.support.edge import EdgeProcess

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

COMPLETIONS = "/serve/acme/chat/v1/completions"


@pytest.fixture
def upstream():
    with Upstream() as server:
        yield server


def test_a_dropped_stream_closes_the_replicas_connection_and_a_late_one_is_cut_at_its_deadline(
        serving, edge, owner, upstream):
    endpoint = serving(1)
    # The replica's address now leads to the slow stream (as a foreign engine would answer).
    Replica.objects.filter(id=endpoint.replicas.get().id).update(address=upstream.url)
    time.sleep(SETTLE_S)
    headers = {"Authorization": f"Bearer {token_for(owner)}"}

    with httpx.stream("POST", edge.url + COMPLETIONS, headers=headers, timeout=30,
                      json={"prompt": "hi", "stream": True, "deadline_ms": 15000}) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        seen = 0
        for line in stream.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break
    assert upstream.closed.wait(10), "the edge kept the upstream connection after its client left"
    assert not upstream.finished.is_set() and upstream.sent < Upstream.EVENTS
    # The deadline travelled as what was left of it from the request's arrival at the edge.
    assert 0 < float(upstream.deadline_header) <= 15000

    upstream.closed.clear()
    with httpx.stream("POST", edge.url + COMPLETIONS, headers=headers, timeout=30,
                      json={"prompt": "hi", "stream": True, "deadline_ms": 1000}) as stream:
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    # Cut at the deadline (plus the edge's margin): far fewer events than the stream holds, and no [DONE].
    assert 0 < len(events) < Upstream.EVENTS and "data: [DONE]" not in events
    assert upstream.closed.wait(10)


def test_every_other_path_and_websockets_pass_through_to_the_web_process(tmp_path, upstream):
    edge = EdgeProcess(tmp_path / "edge.log", upstream=upstream.url).start()
    try:
        answer = httpx.post(f"{edge.url}/echo/page?x=1", content=b"form=1", headers={"Host": "portal.test"})
        seen = answer.json()
        assert answer.status_code == 200 and seen["path"] == "/echo/page" and seen["query"] == "x=1"
        assert seen["body"] == "form=1" and seen["headers"]["host"] == "portal.test"
        # The body's length passes as it came: a WSGI server behind may not take a chunked body.
        assert seen["headers"]["content-length"] == "6" and "transfer-encoding" not in seen["headers"]
        assert seen["headers"]["x-forwarded-for"] == "127.0.0.1" and seen["headers"]["x-forwarded-proto"] == "http"

        with connect(f"ws://127.0.0.1:{edge.port}/ws/echo") as websocket:
            # The client offers permessage-deflate; the edge, which would compress on its one loop, declines.
            assert websocket.response.headers.get("Sec-WebSocket-Extensions") is None
            websocket.send("hello")
            assert websocket.recv(timeout=10) == "echo:hello"
            websocket.send(b"\x00\x01")
            assert websocket.recv(timeout=10) == b"echo:\x00\x01"
            websocket.send("bye")
            with pytest.raises(Exception) as closed:
                websocket.recv(timeout=10)
            assert getattr(closed.value, "rcvd", None) is not None and closed.value.rcvd.code == 4001
        # The upstream gone: the edge answers 502 for the web process, never hangs.
        upstream.__exit__(None, None, None)
        answer = httpx.get(f"{edge.url}/echo/page", timeout=30)
        assert answer.status_code == 502 and "web process" in json.loads(answer.content)["detail"]
    finally:
        edge.stop()


def test_one_clients_cookies_never_reach_another_clients_request(tmp_path, upstream):
    """The edge keeps no cookies of its own: an upstream named by a host name (the web Service on Kubernetes, a
    workspace's server) setting a cookie for one client (a session at sign-in, JupyterLab's _xsrf) must not
    have it sent on another client's requests."""
    edge = EdgeProcess(tmp_path / "edge.log", upstream=f"http://localhost:{upstream.port}").start()
    try:
        signed_in = httpx.post(f"{edge.url}/sign-in")
        assert signed_in.status_code == 200 and "alices-session" in signed_in.headers["set-cookie"]
        stranger = httpx.get(f"{edge.url}/echo/page").json()
        assert "cookie" not in stranger["headers"], stranger["headers"]
        own = httpx.get(f"{edge.url}/echo/page", headers={"Cookie": "sessionid=bobs-session"}).json()
        assert own["headers"]["cookie"] == "sessionid=bobs-session"
    finally:
        edge.stop()
