"""gunicorn serves the portal in every mode: as production runs it, and under `make run` (`manage.py up`)
on the embedded defaults (this checkout's own PostgreSQL and Redis under var/), static files included;
/readyz says when migrations are missing."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest
from django.db.migrations.recorder import MigrationRecorder

from portal import health
from tests.conftest import REPO
from tests.support.worker import wait_for, worker_environment

pytestmark = pytest.mark.e2e

STATIC_FILE = "/static/frontend/portal.css"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers, response.read()  # case-insensitive, as HTTP names are
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def _answering(url: str, process: subprocess.Popen, log_path):
    def check():
        if process.poll() is not None:
            output = log_path.read_text(errors="replace")[-3000:]
            raise AssertionError(f"It exited with {process.returncode}:\n{output}")
        try:
            return _get(url)[0] < 500
        except OSError:
            return False

    return check


def _stop(process: subprocess.Popen, sig=signal.SIGTERM) -> int:
    if process.poll() is None:
        os.killpg(process.pid, sig)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    return process.returncode


@pytest.mark.django_db(transaction=True)
def test_gunicorn_serves_pages_static_files_and_json_access_lines(tmp_path):
    port = _free_port()
    log_path = tmp_path / "gunicorn.log"
    env = worker_environment(LOG_FORMAT="json", GUNICORN_WORKERS="1", GUNICORN_BIND=f"127.0.0.1:{port}")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", "python:portal.gunicorn_conf", "portal.wsgi"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            wait_for(_answering(f"{base}/healthz", process, log_path), timeout_s=60,
                     message=f"gunicorn to answer; see {log_path}")
            status, headers, body = _get(f"{base}/login/", {"X-Request-ID": "trace-login"})
            assert status == 200 and b"<form" in body and headers["X-Request-ID"] == "trace-login"
            status, headers, body = _get(f"{base}{STATIC_FILE}")
            assert status == 200 and headers["Content-Type"].startswith("text/css") and body
            status, _, body = _get(f"{base}/readyz")
            assert status == 200 and json.loads(body)["checks"]["migrations"] == "ok"
        finally:
            assert _stop(process) == 0
    lines = [json.loads(text) for text in log_path.read_text().splitlines() if text.startswith("{")]
    assert any(line["logger"] == "gunicorn.error" and "Booting worker" in line["event"] for line in lines), lines
    [access] = [line for line in lines if line.get("request_id") == "trace-login" and line["logger"] == "portal.access"]
    assert access["status"] == 200 and access["path"] == "/login/" and access["method"] == "GET"
    # One access line per request: gunicorn's own access log stays off.
    assert not any(line["logger"] == "gunicorn.access" for line in lines)


def test_make_run_serves_with_gunicorn_on_the_embedded_defaults(tmp_path):
    """`manage.py up` (what `make run` runs) with no DATABASE_URL nor CELERY_BROKER_URL: the embedded
    PostgreSQL and Redis, DEBUG on, static files straight from the apps (no collectstatic)."""
    port = _free_port()
    log_path = tmp_path / "up.log"
    # Outside pytest's temporary root, which stays private to root; the embedded PostgreSQL runs as
    # an unprivileged user when the tests run as root.
    var_dir = tempfile.mkdtemp(prefix="portal-serving-var-")
    env = {key: value for key, value in os.environ.items()
           if key not in ("DATABASE_URL", "CELERY_BROKER_URL", "CACHE_URL", "CELERY_QUEUE", "DEBUG", "LOG_FORMAT")}
    # One gunicorn worker: the requests here come one at a time, and the default (two a core plus one) would
    # boot workers that nothing uses; the worker count is not what this test is about.
    env.update(PORTAL_VAR_DIR=var_dir, PYTHONUNBUFFERED="1", LOCAL_USE_NVML="false", GUNICORN_WORKERS="1")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "up", "--no-demo", "--addrport", f"127.0.0.1:{port}"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            wait_for(_answering(f"{base}/healthz", process, log_path), timeout_s=180,
                     message=f"`manage.py up` to serve; see {log_path}")
            status, headers, body = _get(f"{base}/login/")
            assert status == 200 and b"<form" in body and len(headers["X-Request-ID"]) == 32
            status, headers, _ = _get(f"{base}{STATIC_FILE}")
            assert status == 200 and headers["Content-Type"].startswith("text/css")
            status, _, body = _get(f"{base}/readyz")
            assert status == 200, body
            assert json.loads(body)["checks"] == {"database": "ok", "migrations": "ok", "broker": "ok"}
            # A worker that dies is started again; the rest of the portal goes on.
            worker = _celery_worker_of(process.pid)
            os.kill(worker, signal.SIGKILL)
            wait_for(lambda: _celery_worker_of(process.pid) not in (None, worker), timeout_s=60,
                     message="`up` to start the killed worker again")
            assert process.poll() is None and _get(f"{base}/healthz")[0] == 200
        finally:
            # Ctrl-C, as a person stops it: gunicorn, the worker and beat all stop, and so does `up`.
            code = _stop(process, signal.SIGINT)
    output = log_path.read_text(errors="replace")
    assert code == 0, output[-3000:]
    assert "Starting gunicorn" in output and "Booting worker" in output
    assert not (tmp_path / "staticfiles").exists()
    time.sleep(0.5)
    with pytest.raises(OSError):
        _get(f"http://127.0.0.1:{port}/healthz")
    # The embedded servers stopped with it.
    status = subprocess.run([sys.executable, "-m", "portal.embedded", "status"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert json.loads(status.stdout)["postgres"] is None and json.loads(status.stdout)["redis"] is None
    subprocess.run([sys.executable, "-m", "portal.embedded", "stop"], cwd=REPO, env=env, timeout=60)
    shutil.rmtree(var_dir, ignore_errors=True)


def _celery_worker_of(pid: int) -> int | None:
    """The pid of the Celery worker's main process that `up` (pid) started, or None."""
    import psutil

    for child in psutil.Process(pid).children():
        try:
            command = child.cmdline()
        except psutil.Error:  # the killed one, a zombie until `up` reaps it
            continue
        if "celery" in command and "worker" in command:
            return child.pid
    return None


@pytest.mark.django_db
def test_readyz_names_migrations_not_applied_and_keeps_the_answer_once_they_are(client, monkeypatch):
    monkeypatch.setattr(health, "_migrated", False)
    recorder = MigrationRecorder.Migration.objects
    last = recorder.filter(app="tenants").order_by("-id").first()
    last.delete()
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable"
    assert body["checks"]["migrations"].startswith("not applied: 1 migration(s) (tenants.")
    assert last.name in body["checks"]["migrations"] and "manage.py migrate" in body["checks"]["migrations"]

    recorder.create(app=last.app, name=last.name)
    assert client.get("/readyz").json()["checks"]["migrations"] == "ok"
    assert health._migrated is True
    # Kept: the recorder is not read again.
    recorder.filter(app="tenants", name=last.name).delete()
    assert client.get("/readyz").json()["checks"]["migrations"] == "ok"
