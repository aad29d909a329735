"""The endpoints' reconcile pass: one at a time, and its replicas probed together, a bounded number at once.

The replicas' jobs are running with no processes behind them; the backend (this module's factory, through
CLUSTER_BACKEND_FACTORY) says each answers at one test server, which counts the probes it holds open at
once and answers only when the test lets it.
"""

from __future__ import annotations

import http.server
import json
import select
import socket
import threading

import pytest
from django.utils import timezone

from runners.backends.local import LocalBackend
from runners.clusters.registry import get_backend, local_backend_options
from runners.inference import reconcile
from runners.inference.models import InferenceEndpoint
from runners.jobs import services as jobs
from runners.jobs.models import JobAttempt, JobState
from runners.scheduling import services as scheduling
from tests.support.endpoints import trained_job
from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment
from tests.support.races import InThread, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


class HeldServer(http.server.ThreadingHTTPServer):
    """Answers /readyz (ready) and /metrics (empty) once ``gate`` is set; counts the requests it holds at once
    (a request whose client gave up and closed is no longer held)."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Held)
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.open = self.most = self.seen = 0
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Held(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the name http.server calls
        server = self.server
        with server.lock:
            server.open += 1
            server.seen += 1
            if not server.gate.is_set():
                # Counted while the gate holds the probes: once it opens, a handler that has answered may not
                # have counted itself out yet when the prober's next request comes in.
                server.most = max(server.most, server.open)
        try:
            while not server.gate.wait(0.01):
                if self._gone():
                    return  # the prober gave up on it (timed out): no longer held
            body = json.dumps({"ready": True}).encode() if self.path == "/readyz" else b""
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        finally:
            with server.lock:
                server.open -= 1

    def _gone(self) -> bool:
        """Whether the client closed its end."""
        if not select.select([self.connection], [], [], 0)[0]:
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def log_message(self, *args):
        pass


class Answering(LocalBackend):
    """The local backend, whose serving replicas all answer at ``address``."""

    address = ""

    def serving_address(self, job_id, attempt, *, namespace=""):
        return Answering.address


def answering_backend() -> Answering:
    return Answering(**local_backend_options())


@pytest.fixture
def server(settings):
    settings.CLUSTER_BACKEND_FACTORY = f"{__name__}.answering_backend"
    settings.ENDPOINT_PROBE_TIMEOUT_S = 60  # a probe waits for the gate, however long the test holds it
    get_backend.cache_clear()
    held = HeldServer()
    Answering.address = held.url
    yield held
    held.gate.set()
    held.shutdown()
    held.server_close()
    get_backend.cache_clear()


@pytest.fixture
def running_replicas(server, tenant, owner, client_for):
    """Two endpoints of two replicas each, their jobs running (no processes: the server answers for them)."""
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=8)
    environment = ready_environment(actor=owner, tenant=tenant)
    source = trained_job(actor=owner, environment=environment)
    client = client_for(owner)
    for name in ("chat", "code"):
        created = client.post("/api/v1/endpoints/", {
            "tenant": tenant.slug, "environment": environment.id, "name": name, "source": {"job": source.id},
            "flavor": "h100-80gb", "gpus_per_replica": 1, "min_replicas": 2, "max_replicas": 2,
            "warm_replicas": 0, "queue_limit": 64, "batch_token_budget": 4096, "max_batch_wait_ms": 5,
            "default_deadline_ms": 10000}, format="json")
        assert created.status_code == 201, created.content
    server.gate.set()
    reconcile.endpoints_reconcile_run()  # starts the replicas' jobs
    assert len(scheduling.cycle_run()["admitted"]) == 4
    for attempt in JobAttempt.objects.open().select_related("job"):
        assert jobs.transition(attempt.job, JobState.LAUNCHING, "test: claimed")
        JobAttempt.objects.filter(id=attempt.id).update(started_at=timezone.now())
        assert jobs.transition(attempt.job, JobState.RUNNING, "test: started")
    server.gate.clear()
    return list(InferenceEndpoint.objects.all())


def test_the_replicas_of_every_endpoint_are_probed_together_at_most_the_bound_at_once(settings, server,
                                                                                       running_replicas):
    """Four replicas, three probes at most at once. Before the fix the pass probed one replica after
    another, endpoint after endpoint: the server never held more than one probe, and four hung replicas
    cost four timeouts."""
    settings.ENDPOINT_PROBE_CONCURRENCY = 3
    the_pass = InThread(reconcile.endpoints_reconcile_run)
    together = wait_until(lambda: server.open >= 3)
    server.gate.set()
    outcomes = the_pass.outcome()
    assert together, f"the probes ran one after another (at most {server.most} at once)"
    assert server.most == 3
    assert sum(outcomes.values()) == 2, outcomes  # each endpoint reconciled
    assert server.seen == 8  # /readyz and /metrics of each of the four replicas, once


def test_a_pass_started_while_another_runs_returns_at_once_and_probes_nothing(settings, server, running_replicas):
    """Before the fix the second pass probed every replica too (it waited on the held server as long
    as the first), then mostly ended "busy" at each endpoint's row. Now it returns at once, skipped."""
    settings.ENDPOINT_PROBE_CONCURRENCY = 1  # the first pass holds one probe open at a time
    first = InThread(reconcile.endpoints_reconcile_run)
    assert wait_until(lambda: server.open >= 1), "the first pass never probed"
    second = InThread(reconcile.endpoints_reconcile_run)
    returned = wait_until(lambda: not second.is_alive() or server.seen > 1)
    probed = server.seen - 1
    server.gate.set()
    assert not probed, "the second pass probed the replicas too"
    assert returned and second.outcome() == {"skipped": "busy"}
    assert sum(first.outcome().values()) == 2
    # The lock went with the first pass: the next one runs.
    assert sum(reconcile.endpoints_reconcile_run().values()) == 2
