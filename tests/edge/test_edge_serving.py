"""The edge in front of real replicas (the shipped server on the local backend): who may call an endpoint,
the bad input it refuses itself, and the replica it leaves for the next one (refused, reset, hung)."""

import os
import signal
import socket
import threading
import time

import httpx
import pytest
from django.test import Client

from runners.inference.models import Replica
from tests.edge.conftest import SETTLE_S
from tests.edge.conftest import token_for as _token

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


GENERATE = "/serve/acme/chat/v1/generate"


def test_callers_are_the_portals_own_and_bad_input_is_refused_naming_the_field(
        serving, edge, owner, viewer, outsider, staff):
    endpoint = serving(1)
    time.sleep(SETTLE_S)
    hello = {"prompt": "hello", "max_tokens": 8}

    answer = edge.post(GENERATE, hello)
    assert answer.status_code == 401 and answer.json() == {"detail": "Authentication credentials were not provided."}
    assert edge.post(GENERATE, hello, token="not-a-token").status_code == 401
    # Another tenant's token: the same 404 as the API's for the endpoint, here and for a name that does not exist.
    answer = edge.post(GENERATE, hello, token=_token(outsider))
    assert answer.status_code == 404 and answer.json() == {"detail": "No such endpoint."}
    assert edge.post("/serve/acme/nothing/v1/generate", hello, token=_token(owner)).status_code == 404
    assert edge.post(GENERATE, hello, token=_token(viewer)).status_code == 403

    token = _token(owner)
    answer = edge.post(GENERATE, hello, token=token)
    assert answer.status_code == 200, answer.text
    assert answer.json()["tokens"] == 8 and answer.headers["X-Portal-Replica"] == str(endpoint.replicas.get().id)
    # The OpenAI client's header (Bearer) is the same token; staff may call every tenant's endpoint.
    answer = httpx.post(edge.url + GENERATE, json=hello, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert answer.status_code == 200, answer.text
    assert edge.post(GENERATE, hello, token=_token(staff)).status_code == 200

    # The session cookie of a logged-in member, with the page's CSRF token (as "Try it" sends it); without it, 403.
    browser = Client()
    browser.force_login(owner)
    cookie = f"sessionid={browser.cookies['sessionid'].value}; csrftoken={'a' * 32}"
    answer = httpx.post(edge.url + GENERATE, json=hello, headers={"Cookie": cookie}, timeout=30)
    assert answer.status_code == 403 and "CSRF" in answer.json()["detail"]
    answer = httpx.post(edge.url + GENERATE, json=hello, headers={"Cookie": cookie, "X-CSRFToken": "a" * 32},
                        timeout=30)
    assert answer.status_code == 200, answer.text

    # Bad input: each a 4xx naming what is wrong, never a 500, nothing forwarded.
    big = b'{"prompt": "' + b"a" * (64 * 1024) + b'", "max_tokens": 4}'
    answer = edge.post(GENERATE, content=big, token=token, headers={"Content-Type": "application/json"})
    assert answer.status_code == 413 and "body" in answer.json()

    def chunked():
        for _ in range(80):
            yield b"a" * 1024

    answer = httpx.post(edge.url + GENERATE, content=chunked(), timeout=30,
                        headers={"Authorization": f"Token {token}", "Content-Type": "application/json"})
    assert answer.status_code == 413 and "body" in answer.json()
    answer = edge.post(GENERATE, content=b'{"prompt": "hi", "max_tokens": ', token=token)
    assert answer.status_code == 400 and "body" in answer.json()
    answer = edge.post(GENERATE, content=b"[1, 2]", token=token)
    assert answer.status_code == 400 and "body" in answer.json()
    for deadline in (b"0", b"-5", b"NaN", b"1e400", b"1" + b"0" * 400, b"true", b'"soon"'):
        answer = edge.post(GENERATE, content=b'{"prompt": "hi", "max_tokens": 4, "deadline_ms": ' + deadline + b"}",
                           token=token)
        assert answer.status_code == 400 and list(answer.json()) == ["deadline_ms"], (deadline, answer.text)
    answer = edge.post("/serve/acme/chat/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": "yes"},
                       token=token)
    assert answer.status_code == 400 and list(answer.json()) == ["stream"]
    answer = edge.post("/serve/acme/chat/v1/elsewhere", hello, token=token)
    assert answer.status_code == 404
    # The server's own checks come through, naming its field.
    answer = edge.post(GENERATE, {"prompt": "", "max_tokens": 8}, token=token)
    assert answer.status_code == 400 and "prompt" in answer.json()
    assert httpx.get(edge.url + GENERATE, headers={"Authorization": f"Token {token}"}).status_code == 405


def _resetting_server() -> tuple[socket.socket, str]:
    """A port that takes connections and resets each at once (a replica that crashed mid-accept)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def run():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            conn.close()

    threading.Thread(target=run, daemon=True).start()
    return listener, f"http://127.0.0.1:{listener.getsockname()[1]}"


def _closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_replica_that_refuses_or_resets_is_left_for_the_next(serving, edge, owner):
    endpoint = serving(2)
    first, second = endpoint.replicas.order_by("id")
    token = _token(owner)
    listener, resetting = _resetting_server()
    try:
        for broken in (_closed_port(), resetting):
            # The first replica's address now answers with a refusal or a reset; the edge tries it (the
            # least loaded, lowest id) and moves on to the second within the request's deadline.
            Replica.objects.filter(id=first.id).update(address=broken)
            time.sleep(SETTLE_S)
            for _ in range(3):
                answer = edge.post(GENERATE, {"prompt": "hello", "max_tokens": 4, "deadline_ms": 5000}, token=token)
                assert answer.status_code == 200, answer.text
                assert answer.headers["X-Portal-Replica"] == str(second.id)
    finally:
        listener.close()


def _process_group(replica) -> int:
    from runners.clusters.registry import get_backend
    from runners.workloads import supervise

    attempt = replica.job.attempts.get(ended_at__isnull=True)
    pid_file = get_backend().jobs.attempt_dir(replica.job_id, attempt.number) / supervise.PID_FILE
    return int(pid_file.read_text().split()[1])


def test_a_hung_replica_costs_at_most_one_requests_deadline_before_traffic_moves(serving, edge, owner):
    """SIGSTOP: the port still takes connections and nothing answers. The request sent to it goes to the
    other replica once the edge's probes find it silent (two in a row), within that request's deadline;
    from then on it is out of rotation, without waiting for the reconcile."""
    endpoint = serving(2)
    hung, healthy = endpoint.replicas.select_related("job").order_by("id")
    token = _token(owner)
    time.sleep(SETTLE_S)
    group = _process_group(hung)
    os.killpg(group, signal.SIGSTOP)
    try:
        # Two at once: the second goes to the less loaded replica, so one of them is sent to the hung one.
        answers = []
        pair = [threading.Thread(target=lambda: answers.append(edge.post(
            GENERATE, {"prompt": "hello", "max_tokens": 8, "deadline_ms": 5000}, token=token))) for _ in range(2)]
        for thread in pair:
            thread.start()
        for thread in pair:
            thread.join(30)
        assert [(a.status_code, a.headers.get("X-Portal-Replica")) for a in answers] == [(200, str(healthy.id))] * 2
        assert "stopped answering; its request goes to the next one" in edge.output()
        for _ in range(5):
            answer = edge.post(GENERATE, {"prompt": "hello", "max_tokens": 8, "deadline_ms": 5000}, token=token)
            assert (answer.status_code, answer.headers.get("X-Portal-Replica")) == (200, str(healthy.id))
        hung.refresh_from_db()
        assert hung.ready  # the reconcile has not looked: the edge moved on by itself
        assert "out of rotation" in edge.output()
    finally:
        os.killpg(group, signal.SIGCONT)


def test_under_overload_every_request_is_answered_refused_or_expired(serving, edge, owner):
    """Far more requests than one replica can answer within their deadline, all at once: each one gets an
    answer (200), a refusal with Retry-After (429 / 503) or a 504; none is left waiting unseen."""
    serving(1, queue_limit=4)
    token = _token(owner)
    time.sleep(SETTLE_S)
    results: list[tuple[int, dict]] = []
    lock = threading.Lock()
    # All forty leave at once: started one by one, on a fast machine the first ones were answered before the
    # last ones were sent, and the replica never saw more than it could take.
    together = threading.Barrier(40)

    def one():
        together.wait(30)
        try:
            answer = edge.post(GENERATE, {"prompt": "hello there", "max_tokens": 64, "deadline_ms": 1500},
                               token=token, timeout=30)
            outcome = (answer.status_code, dict(answer.headers))
        except httpx.HTTPError as exc:
            outcome = (0, {"error": repr(exc)})
        with lock:
            results.append(outcome)

    threads = [threading.Thread(target=one) for _ in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 40
    for status, headers in results:
        assert status in (200, 429, 503, 504), (status, headers)
        if status in (429, 503):
            assert int(headers["retry-after"]) >= 1
    statuses = [status for status, _ in results]
    assert 200 in statuses and any(status in (429, 503, 504) for status in statuses), statuses
