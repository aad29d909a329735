"""The edge (`python -m runners.edge`) in front of one replica, for bench/serve_load.py's `portal` runs.

A scratch PostgreSQL database (DATABASE_URL's server; created here, dropped at the end) holds what the
edge reads: one tenant, its owner and an API token, an endpoint `chat` at the deployed defaults
(`ServingSettings`) in state ready, and one ready replica whose job runs, its address the replica
the bench started. The edge runs as it is deployed (its own defaults, no bench-only setting), pinned to
the servers' core: it is part of the portal's side. Each run gets a fresh replica and a fresh edge;
the replica's row is pointed at the new address and the edge started after, so its first table
read has it.

Needs DATABASE_URL (and CELERY_BROKER_URL, which the settings read) in the environment.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TENANT, ENDPOINT = "bench", "chat"


def available() -> bool:
    """Whether the edge is on main: runners/edge/app.py tracked by git (not only in someone's work tree)."""
    found = subprocess.run(["git", "ls-files", "--error-unmatch", "runners/edge/app.py"], cwd=REPO,
                           capture_output=True)
    return found.returncode == 0


class EdgeSetup:
    """The scratch database and its rows; `start(replica_url, core)` an edge in front of that replica."""

    def __init__(self) -> None:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
        import django

        django.setup()
        from django.conf import settings
        from django.db import connection

        self.original = connection.settings_dict["NAME"]
        connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
        database = settings.DATABASES["default"]
        self.database_url = (f"postgres://{database['USER']}@{database['HOST'] or '127.0.0.1'}:"
                             f"{database['PORT'] or 5432}/{database['NAME']}")
        try:
            self.token, self.replica_id = self._rows()
        except BaseException:
            self.close()
            raise
        self.path = f"/serve/{TENANT}/{ENDPOINT}/v1/generate"

    def _rows(self) -> tuple[str, int]:
        from django.contrib.auth import get_user_model
        from django.utils import timezone

        from runners.backends.base import ServingSettings
        from runners.inference.models import EndpointState, InferenceEndpoint, Replica
        from runners.jobs.models import Job, JobState
        from tenants.models import Membership, Tenant
        from tenants.services import token_create
        from tests.support.jobs import demo_cluster_with_flavors, ready_environment

        owner = get_user_model().objects.create_user("bench-owner", password="x" * 16)
        tenant = Tenant.objects.create(slug=TENANT, name="Bench")
        Membership.objects.create(user=owner, tenant=tenant, role="owner")
        flavor = demo_cluster_with_flavors()["h100-80gb"]
        environment = ready_environment(actor=owner, tenant=tenant)
        deployed = ServingSettings(endpoint_id=0, checkpoint="")
        spec = {name: getattr(deployed, name) for name in (
            "queue_limit", "batch_token_budget", "max_batch_wait_ms", "default_deadline_ms", "max_deadline_ms")}
        endpoint = InferenceEndpoint.objects.create(
            tenant=tenant, environment=environment, name=ENDPOINT, spec=spec, flavor=flavor, gpus_per_replica=1,
            min_replicas=1, max_replicas=1, desired_replicas=1, state=EndpointState.READY, created_by=owner)
        job = Job.objects.create(tenant=tenant, environment=environment, name="chat-replica-0", spec={},
                                 flavor=flavor, replicas=1, gpus_per_replica=1, state=JobState.RUNNING)
        replica = Replica.objects.create(endpoint=endpoint, job=job, slot=0, generation=1, ready=True,
                                         ready_since=timezone.now())
        return token_create(user=owner, name="bench")[1], replica.id

    def start(self, replica_url: str, core: int) -> EdgeProcess:
        from runners.inference.models import Replica

        Replica.objects.filter(id=self.replica_id).update(address=replica_url)
        return EdgeProcess(self.database_url, core)

    def close(self) -> None:
        from django.db import connection

        connection.creation.destroy_test_db(self.original, verbosity=0)


class EdgeProcess:
    def __init__(self, database_url: str, core: int) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        env = {**os.environ, "DATABASE_URL": database_url, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.log = open(f"/tmp/serve-load-edge-{os.getpid()}.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runners.edge", "--bind", f"127.0.0.1:{self.port}"], cwd=REPO, env=env,
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, {core}),
        )

    def wait_route(self, path: str, token: str, timeout_s: float = 120) -> None:
        """Until the edge answers a request to the endpoint other than 'no such endpoint' / 'no replica'."""
        import http.client

        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the edge exited with {self.proc.returncode}; see {self.log.name}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("POST", path, body=b'{"prompt": "hi", "max_tokens": 1}',
                             headers={"Content-Type": "application/json", "Authorization": f"Token {token}"})
                response = conn.getresponse()
                response.read()
                conn.close()
                if response.status == 200:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"the edge did not route to the replica; see {self.log.name}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
