"""A real Celery worker for integration tests: a `celery worker` subprocess on this run's database and queue."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from django.conf import settings

REPO = Path(__file__).resolve().parent.parent.parent


def worker_environment(**overrides) -> dict[str, str]:
    """Environment for a worker process that shares this test run's database and queue."""
    database = settings.DATABASES["default"]
    env = dict(os.environ)
    env.update(
        DATABASE_URL=f"postgres://{database['USER']}@{database['HOST']}:{database['PORT'] or 5432}/{database['NAME']}",
        CELERY_BROKER_URL=settings.CELERY_BROKER_URL,
        CELERY_QUEUE=settings.CELERY_TASK_DEFAULT_QUEUE,
        LOCAL_WORKSPACE_DIR=str(settings.LOCAL_WORKSPACE_DIR),
        LOCAL_JOBS_DIR=str(settings.LOCAL_JOBS_DIR),
        DATA_STORAGE_URL=settings.DATA_STORAGE_URL,
        DATA_STORAGE_OPTIONS=json.dumps(settings.DATA_STORAGE_OPTIONS),
        NODE_CACHE_DIR=str(settings.NODE_CACHE_DIR),
        PREEMPTION_GRACE_PERIOD_S=str(settings.PREEMPTION_GRACE_PERIOD_S),
        LOCAL_PROVISION_DELAY_S=str(settings.LOCAL_PROVISION_DELAY_S),
        LOCAL_USE_NVML=str(settings.LOCAL_USE_NVML),
        LOCAL_CLUSTER_FILE=str(settings.LOCAL_CLUSTER_FILE),
        PARTITION_POLL_INTERVAL_S=str(settings.PARTITION_POLL_INTERVAL_S),
        CLUSTER_BACKEND=settings.CLUSTER_BACKEND,
        CLUSTER_BACKEND_FACTORY=settings.CLUSTER_BACKEND_FACTORY,
        KUBECONFIG=str(settings.KUBECONFIG or ""),
        KUBERNETES_NAMESPACE_DELETE_TIMEOUT_S=str(settings.KUBERNETES_NAMESPACE_DELETE_TIMEOUT_S),
        PYTHONUNBUFFERED="1",
    )
    env.update({key: str(value) for key, value in overrides.items()})
    return env


class WorkerProcess:
    """A `celery worker` subprocess; start() waits until it consumes from the queue."""

    def __init__(self, log_path: Path, *, beat: bool = False, **env_overrides):
        """``beat``: run Celery beat inside this worker (``-B``), for the periodic cycle and reconcile."""
        self.log_path = log_path
        self.beat = beat
        self.env = worker_environment(**env_overrides)
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60) -> "WorkerProcess":
        self.log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "portal", "worker", "-l", "INFO", "--concurrency", "1",
             "--without-gossip", "--without-mingle", "--hostname", f"test-{uuid.uuid4().hex[:8]}@%h",
             *(["-B", "--schedule", str(self.log_path.with_suffix(".beat"))] if self.beat else [])],
            cwd=REPO, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"Worker exited early; see {self.log_path}:\n{self.log_path.read_text()[-3000:]}")
            if b"ready." in self.log_path.read_bytes():
                return self
            time.sleep(0.05)
        raise RuntimeError(f"Worker did not become ready in {timeout_s}s; see {self.log_path}")

    def kill(self) -> None:
        """SIGKILL the whole worker (main process and pool children), like a lost node."""
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


def purge_queue(queue: str | None = None) -> None:
    """Drop every message waiting in this run's queue.

    A test that sends tasks without a worker leaves them queued; the next test's worker must
    not run them against rows that test's database no longer has.
    """
    import redis

    queue = queue or settings.CELERY_TASK_DEFAULT_QUEUE
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    # Kombu keeps a queue's messages in a list named after it (and one per priority, suffixed).
    client.delete(queue, *client.keys(f"{queue}*"))


def clear_cache() -> int:
    """Empty this run's part of Django's cache (the keys under its KEY_PREFIX); returns how many were removed.

    Never ``cache.clear()`` in a test: on Redis it is FLUSHDB, and the cache shares its database with the
    broker, so it also empties every test process's queues, unacknowledged messages and exchange bindings. A
    message a worker holds unacknowledged is then never handed to another, and one restored finds no binding and
    is dropped (tests/test_shared_redis.py keeps the call out of the suite).
    """
    import redis

    cache = settings.CACHES["default"]
    client = redis.Redis.from_url(cache["LOCATION"])
    keys = list(client.scan_iter(match=f"{cache['KEY_PREFIX']}:*", count=1000))
    return client.delete(*keys) if keys else 0


def wait_for(predicate, *, timeout_s: float = 30, interval_s: float = 0.2, message: str = "condition"):
    """Poll until predicate() is truthy; fail with the message otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"Timed out after {timeout_s}s waiting for {message}.")
