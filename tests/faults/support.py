"""What the fault tests share: a traced test backend, a private Redis, beat and gunicorn processes, SQL probes.

``FaultJobs`` is ``ChaosQuickJobs`` (timers for trainers, the state on disk so every process sees
it) that also writes a line to FAULTS_TRACE for each reconcile pass (``jobs_open``), each launch
and each environment built, and whose ``jobs_open`` waits while the file FAULTS_HOLD exists: the
reconcile pass that took the lock then holds it for as long as a test wants.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psycopg
import redis
import requests
from django.conf import settings
from django.db import connection

from runners.clusters.registry import local_backend_options
from tests.support.chaos import ChaosQuickJobs
from tests.support.worker import REPO, wait_for, worker_environment

FACTORY = "tests.faults.support.fault_jobs"


def _trace(what: str, *fields) -> None:
    path = os.environ.get("FAULTS_TRACE")
    if path:
        with open(path, "a") as out:
            out.write(" ".join([f"{time.time():.3f}", str(os.getpid()), what, *map(str, fields)]) + "\n")


class FaultJobs(ChaosQuickJobs):
    def jobs_open(self, attempts):
        _trace("pass")
        hold = os.environ.get("FAULTS_HOLD")
        deadline = time.monotonic() + 120
        while hold and os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.05)
        return super().jobs_open(attempts)

    def launch_job(self, launch):
        fresh = self._read(launch.job_id, launch.attempt) is None
        result = super().launch_job(launch)
        _trace("launch", launch.job_id, launch.attempt, "created" if fresh else "found")
        return result

    def ensure_environment(self, spec):
        result = super().ensure_environment(spec)
        _trace("environment", spec.environment_id)
        return result


def fault_jobs() -> FaultJobs:
    return FaultJobs(**local_backend_options())


def trace_lines(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [line.split() for line in path.read_text().splitlines() if line.strip()]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- Processes ----------------------------------------------------------------------------


class PrivateRedis:
    """A redis-server of the test's own, on a free loopback port, with no persistence."""

    def __init__(self, log_path: Path):
        self.port, self.log_path, self.process = free_port(), log_path, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def answers(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.url, socket_timeout=1).ping())
        except redis.exceptions.ConnectionError:
            return False

    def start(self) -> "PrivateRedis":
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--daemonize", "no"], stdout=log, stderr=subprocess.STDOUT,
            )
        wait_for(self.answers, timeout_s=10, interval_s=0.05, message=f"redis-server on port {self.port}")
        return self

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


class Process:
    """A subprocess in its own process group (beat, gunicorn), its output in a log file."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str]):
        self.argv, self.log_path, self.env, self.process = argv, log_path, env, None

    def start(self, ready: bytes | None = None, timeout_s: float = 60) -> "Process":
        self.log = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.argv, cwd=REPO, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        if ready is not None:
            def up():
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.argv[:4]} exited early:\n{self.output()[-3000:]}")
                return ready in self.log_path.read_bytes()

            wait_for(up, timeout_s=timeout_s, message=f"{' '.join(self.argv[2:5])} to start")
        return self

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        if self.process:
            self.log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


def beat(log_path: Path, **env) -> Process:
    """A `celery beat` process (the DatabaseScheduler of the settings), on the test's database."""
    return Process([sys.executable, "-m", "celery", "-A", "portal", "beat", "-l", "INFO",
                    "--schedule", str(log_path.with_suffix(".schedule"))], log_path, worker_environment(**env))


class Gunicorn(Process):
    """`gunicorn portal.wsgi` on a free port, on the test's database (its connections named ``app_name``)."""

    def __init__(self, log_path: Path, *, workers: int = 2, threads: int = 1, app_name: str = "faults-web", **env):
        self.port, self.app_name = free_port(), app_name
        super().__init__(
            [sys.executable, "-m", "gunicorn", "portal.wsgi", "-b", f"127.0.0.1:{self.port}", "-w", str(workers),
             *(["--worker-class", "gthread", "--threads", str(threads)] if threads > 1 else []),
             "--timeout", "30", "--graceful-timeout", "5", "--no-control-socket"],
            log_path, worker_environment(PGAPPNAME=app_name, **env),
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready: bytes | None = None, timeout_s: float = 60) -> "Gunicorn":
        super().start()

        def answers():
            if self.process.poll() is not None:
                raise RuntimeError(f"gunicorn exited early:\n{self.output()[-3000:]}")
            try:
                return requests.get(f"{self.url}/healthz", timeout=5).status_code == 200
            except requests.RequestException:
                return False

        wait_for(answers, timeout_s=timeout_s, interval_s=0.2, message="gunicorn to answer /healthz")
        return self

    def stop(self) -> None:
        super().stop()
        # A killed worker's database backend may outlive it a moment; the test database is dropped after.
        wait_for(lambda: not _connections_named(self.app_name), timeout_s=15, message="the server's connections to end")

    def worker_pids(self) -> list[int]:
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        try:
            return [int(pid) for pid in children.read_text().split()]
        except FileNotFoundError:
            return []

    def busy_workers(self) -> list[int]:
        """The workers holding a client's connection now (a sync worker: in the middle of a request)."""
        clients = set()
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == self.port and fields[3] == "01":  # ESTABLISHED
                clients.add(f"socket:[{fields[9]}]")
        busy = []
        for pid in self.worker_pids():
            try:
                targets = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            except OSError:
                continue
            if targets & clients:
                busy.append(pid)
        return busy


# --- The database, seen from outside Django's connection ------------------------------------


def raw_connection(**kwargs) -> psycopg.Connection:
    """A connection of the test's own to the test database (not Django's), e.g. to hold a row lock."""
    db = settings.DATABASES["default"]
    return psycopg.connect(dbname=db["NAME"], user=db["USER"], host=db["HOST"], port=db["PORT"] or 5432,
                           application_name="faults-test", **kwargs)


def _connections_named(app_name: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND application_name = %s", [app_name])
        return cursor.fetchone()[0]


def advisory_holders(key: int) -> list[tuple[int, str, bool]]:
    """Who holds or waits for the advisory lock of this key: (backend pid, application_name, granted)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT l.pid, coalesce(a.application_name, ''), l.granted FROM pg_locks l "
            "JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND ((l.classid::bigint << 32) | l.objid::bigint) = %s",
            [key],
        )
        return list(cursor.fetchall())


# --- An API client of the test's own -----------------------------------------------------------


def api_token(user) -> str:
    from tenants.services import token_create

    return token_create(user=user, name="fault test")[1]


class Calls:
    """Every final answer the clients got, kept in order (thread-safe)."""

    def __init__(self):
        self.lock, self.rows = threading.Lock(), []

    def add(self, **row) -> None:
        with self.lock:
            self.rows.append(row)

    def statuses(self) -> list:
        with self.lock:
            return [row["status"] for row in self.rows]


def submit_body(environment, name: str, **overrides) -> dict:
    from tests.support.jobs import job_data

    return json.loads(json.dumps(job_data(
        environment, name=name, replicas=1, gpus_per_replica=1, steps=20, checkpoint_every_steps=0,
        topology={"level": "none", "mode": "required"}, **overrides,
    )))


def new_key() -> str:
    return uuid.uuid4().hex


def quota_world(settings_fixture, tenant, owner):
    """The fault backend picked, the demo cluster with 8 H100s guaranteed to the tenant, and a ready
    environment: that environment, with the invariants' baseline taken after it."""
    from runners.clusters.registry import get_backend
    from tests.support import invariants
    from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment

    settings_fixture.CLUSTER_BACKEND_FACTORY = FACTORY
    get_backend.cache_clear()
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    environment = ready_environment(actor=owner, tenant=tenant)
    return environment, invariants.baseline()

