"""Structured logs: every request has an id, in its answer, in each line logged while serving it and in
the lines of the tasks it enqueued, run by a real worker; and error reports reach Sentry when it is set."""

import io
import json
import logging
import subprocess
import sys
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import sentry_sdk
from django.test import Client

from portal import logs
from runners.environments.models import Environment
from tests.conftest import REPO
from tests.support.worker import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.django_db]


@pytest.fixture
def json_lines():
    """What the root logger writes, rendered as LOG_FORMAT=json renders it: a function giving the lines."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.formatter("json"))
    root = logging.getLogger()
    previous = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    root.removeHandler(handler)
    root.setLevel(previous)


def test_each_answer_carries_a_new_request_id():
    first, second = Client().get("/healthz"), Client().get("/healthz")
    assert len(first["X-Request-ID"]) == 32 and int(first["X-Request-ID"], 16) >= 0
    assert first["X-Request-ID"] != second["X-Request-ID"]


@pytest.mark.parametrize("incoming", ["abc-123", "0af7651916cd43dd8448eb211c80319c", "lb.trace:7_8"])
def test_a_valid_incoming_request_id_is_kept(incoming):
    assert Client().get("/healthz", HTTP_X_REQUEST_ID=incoming)["X-Request-ID"] == incoming


@pytest.mark.parametrize("incoming", ["x" * 129, "has space", "<script>", "id;drop", "ünï", ""])
def test_a_bad_incoming_request_id_is_replaced(incoming):
    answered = Client().get("/healthz", HTTP_X_REQUEST_ID=incoming)["X-Request-ID"]
    assert answered != incoming and len(answered) == 32


def test_json_lines_carry_the_request_id_with_an_access_line_per_request(json_lines, client, owner):
    client.force_login(owner)
    response = client.get("/no-such-page/", HTTP_X_REQUEST_ID="trace-404")
    assert response.status_code == 404 and response["X-Request-ID"] == "trace-404"
    lines = [line for line in json_lines() if line.get("request_id") == "trace-404"]
    for line in lines:
        assert {"timestamp", "level", "logger", "event"} <= set(line), line
    # Django's own warning about the 404, written while serving the request, and the access line.
    assert any(line["logger"] == "django.request" and line["level"] == "warning" for line in lines), lines
    [access] = [line for line in lines if line["logger"] == "portal.access"]
    assert access["method"] == "GET" and access["path"] == "/no-such-page/" and access["status"] == 404
    assert access["user_id"] == owner.id and access["duration_ms"] >= 0
    assert access["timestamp"].endswith("Z")
    # Nothing is left bound once the request is answered.
    logging.getLogger("after").info("later")
    assert "request_id" not in json_lines()[-1]


def test_a_refused_request_has_an_id_and_an_access_line_too(json_lines):
    response = Client().get("/healthz", HTTP_X_FORWARDED_FOR="1.2.3.4\x00")
    assert response.status_code == 400
    [access] = [line for line in json_lines() if line["logger"] == "portal.access"]
    assert access["request_id"] == response["X-Request-ID"] and access["status"] == 400 and access["user_id"] is None


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_a_task_enqueued_by_a_request_logs_its_request_id_in_the_worker(celery_worker_factory, client_for, owner,
                                                                         tenant):
    worker = celery_worker_factory(LOG_FORMAT="json")
    response = client_for(owner).post("/api/v1/environments/", {"tenant": "acme", "name": "train"},
                                      HTTP_X_REQUEST_ID="trace-env-create")
    assert response.status_code == 201 and response["X-Request-ID"] == "trace-env-create"
    environment_id = response.json()["id"]
    wait_for(lambda: Environment.objects.get(id=environment_id).state == "ready", message="the environment to be ready")

    def provision_lines():
        lines = []
        for text in worker.output().splitlines():
            try:
                line = json.loads(text)
            except ValueError:
                continue
            if line.get("task") == "runners.tasks.environment_provision":
                lines.append(line)
        return lines

    lines = wait_for(provision_lines, message="the provision task's log lines")
    assert all(line["request_id"] == "trace-env-create" and line["task_id"] for line in lines), lines
    assert any("succeeded" in line["event"] for line in lines), lines
    # A task no request sent (beat's, or the worker's own) carries no request id, nor this one.
    others = [json.loads(text) for text in worker.output().splitlines() if text.startswith("{")]
    assert not any(line.get("request_id") == "trace-env-create" for line in others if line not in lines)


def test_without_sentry_dsn_nothing_reports():
    assert not sentry_sdk.get_client().is_active()


SENTRY_SCRIPT = """
import os
import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django.setup()

import sentry_sdk
from django.test import Client

from portal import health


def boom(request):
    raise RuntimeError("sentry-test-boom")


health.healthz = boom  # before the URLs are imported, so /healthz routes here
response = Client(raise_request_exception=False).get("/healthz", HTTP_HOST="localhost", HTTP_X_REQUEST_ID="trace-boom")
print(response.status_code, sentry_sdk.get_client().is_active())
sentry_sdk.flush(timeout=10)
"""


class _Envelopes(BaseHTTPRequestHandler):
    received: list[bytes] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        encoding = self.headers.get("Content-Encoding", "")
        if encoding == "gzip":
            body = zlib.decompress(body, 16 + zlib.MAX_WBITS)
        elif encoding == "br":
            import brotli

            body = brotli.decompress(body)
        type(self).received.append(body)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_with_sentry_dsn_an_exception_in_a_view_is_reported(tmp_path):
    _Envelopes.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Envelopes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        dsn = f"http://publickey@127.0.0.1:{server.server_port}/42"
        script = tmp_path / "sentry_check.py"
        script.write_text(SENTRY_SCRIPT)
        env = {key: value for key, value in __import__("os").environ.items() if not key.startswith("SENTRY_")}
        env.update(SENTRY_DSN=dsn, SENTRY_ENVIRONMENT="test-env", PYTHONPATH=str(REPO))
        result = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.split()[-2:] == ["500", "True"], result.stdout
        wait_for(lambda: any(b"sentry-test-boom" in body for body in _Envelopes.received), timeout_s=10,
                 message="the error envelope")
    finally:
        server.shutdown()
    [envelope] = [body for body in _Envelopes.received if b"sentry-test-boom" in body]
    items = [json.loads(line) for line in envelope.splitlines() if line.startswith(b"{")]
    [event] = [item for item in items if "exception" in item]
    [exception] = event["exception"]["values"]
    assert exception["type"] == "RuntimeError" and exception["value"] == "sentry-test-boom"
    assert event["environment"] == "test-env"
    assert event["tags"]["request_id"] == "trace-boom"
    assert "user" not in event or not event["user"].get("ip_address")
