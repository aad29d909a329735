"""The portal as a newcomer runs it: `manage.py up` (migrate, demo, gunicorn, a worker and beat) as a subprocess.

    with fresh_database() as database_url, started_portal({"DATABASE_URL": database_url, ...}, tmp_path) as url:
        ...  # url answers /readyz

`started_portal` waits for /readyz, stops the whole process group at the end (and the job processes the
local backend detached), and adds the process's log to any exception raised inside it.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
from django.conf import settings

REPO = Path(__file__).resolve().parent.parent.parent
LOG_TAIL_CHARS = 20000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _server_url(database: str) -> str:
    """A postgres:// URL for ``database`` on the test run's PostgreSQL server."""
    default = settings.DATABASES["default"]
    password = f":{default['PASSWORD']}" if default.get("PASSWORD") else ""
    return f"postgres://{default['USER']}{password}@{default['HOST'] or '127.0.0.1'}:{default['PORT'] or 5432}/{database}"


@contextlib.contextmanager
def fresh_database(prefix: str = "portal_up", *, migrated: bool = False) -> Iterator[str]:
    """A database of its own on the test PostgreSQL, dropped afterwards: its DATABASE_URL. Empty, as a newcomer's
    is, or with ``migrated`` a copy of the suite's migrated template (tests/support/template_db.py), for tests
    about what runs on the portal rather than its first start."""
    from tests.support.template_db import copy_of_template

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = _server_url("postgres")
    if migrated:
        copy_of_template(name)
    else:
        with psycopg.connect(admin, autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _server_url(name)
    finally:
        with psycopg.connect(admin, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


def kill_job_processes(jobs_dir: Path) -> None:
    """The local backend's job processes live in sessions of their own; a finished run must leave none."""
    for pid_file in jobs_dir.glob("*/attempts/*/supervisor.pid"):
        try:
            os.killpg(int(pid_file.read_text().split()[1]), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, ValueError, IndexError):
            pass


def _stop(process: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM to the process group (`up` stops its three children), SIGKILL to whatever is left after the wait."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


@contextlib.contextmanager
def started_portal(env_overrides: dict[str, str], var_dir: Path, *, timeout_s: float = 180) -> Iterator[str]:
    """`manage.py up` on a free loopback port, PORTAL_VAR_DIR at ``var_dir``: its base URL once /readyz answers 200.

    ``env_overrides`` goes over this process's environment (DATABASE_URL and CELERY_BROKER_URL at least).
    Each start gets a Celery queue of its own unless CELERY_QUEUE is given, and two gunicorn workers
    (GUNICORN_WORKERS; each serves four requests at once) unless GUNICORN_WORKERS is given: the default, two a
    core plus one, would boot workers that no test here counts or keeps busy.
    """
    var_dir = Path(var_dir)
    var_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    env.update(PORTAL_VAR_DIR=str(var_dir), CELERY_QUEUE=f"portal-up-{uuid.uuid4().hex[:8]}", PYTHONUNBUFFERED="1",
               GUNICORN_WORKERS="2")
    env.update({key: str(value) for key, value in env_overrides.items()})
    log_path = var_dir / "portal-up.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "up", "--addrport", f"127.0.0.1:{port}"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def log_tail() -> str:
        return log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]

    try:
        deadline = time.monotonic() + timeout_s
        while not _ready(url):
            if process.poll() is not None:
                raise RuntimeError(f"manage.py up exited with code {process.returncode} before /readyz answered 200")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}/readyz did not answer 200 within {timeout_s:.0f} s")
            time.sleep(0.5)
        yield url
    except BaseException as exc:
        exc.add_note(f"--- manage.py up's log ({log_path}), its end ---\n{log_tail()}")
        raise
    finally:
        _stop(process, timeout_s=30)
        kill_job_processes(Path(env.get("LOCAL_JOBS_DIR") or var_dir / "jobs"))


def ready_environment_through_api(url: str, token: str, *, tenant: str, name: str, timeout_s: float = 120) -> int:
    """Ask the portal at ``url`` for an environment as its Environments page does (the API, with ``token``), and
    wait until a worker has made it ready: its id."""
    import httpx

    with httpx.Client(base_url=url, headers={"Authorization": f"Token {token}"}) as api:
        created = api.post("/api/v1/environments/", json={"tenant": tenant, "name": name})
        assert created.status_code == 201, created.text
        deadline = time.monotonic() + timeout_s
        while api.get(f"/api/v1/environments/{created.json()['id']}/").json()["state"] != "ready":
            assert time.monotonic() < deadline, f"the environment {tenant}/{name} did not become ready"
            time.sleep(0.5)
    return created.json()["id"]
