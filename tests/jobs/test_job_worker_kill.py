"""A worker SIGKILLed mid-launch, then the broker restarted without persistence: the job still runs, in bounded time.

The worker runs on a private redis-server of this test's own (no RDB, no AOF), so the launch
message it held unacknowledged is lost for good when that Redis is killed and started again empty:
nothing but the database says a launch was under way. The killed launch had started the job's
replicas (`ChaosQuickJobs` with CHAOS_LAUNCH_DELAY_AFTER: the launch sleeps after starting them)
and never recorded the start. A new worker with beat comes up; its reconcile finds the attempt
`launching` with a launch lease nobody renews, and once the lease (JOB_LAUNCH_LEASE_S) has run out
it launches again under a fresh token. The launch is idempotent: the replicas already started are
found, not started twice, and the job is `running` on its first attempt.

The figure (seconds from the SIGKILL to `running`) is printed and recorded as a test property, for
the lease this test sets (3 s) and for the default (15 s).
"""

import socket
import subprocess
import time

import pytest
import redis
from django.utils import timezone

from portal.settings import unacked_keys
from runners.clusters.registry import get_backend
from runners.jobs import services as jobs
from runners.jobs.models import Job
from tests.support.chaos import FACTORY_QUICK
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment
from tests.support.worker import WorkerProcess, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

DEFAULT_LEASE_S = 15


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PrivateRedis:
    """A redis-server subprocess on a loopback port, with no persistence: killed, it forgets everything."""

    def __init__(self, port: int, log_path):
        self.port, self.log_path, self.process = port, log_path, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2)

    def start(self) -> "PrivateRedis":
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--daemonize", "no"], stdout=log, stderr=subprocess.STDOUT,
            )

        def answers():
            try:
                return self.client().ping()
            except redis.exceptions.ConnectionError:
                return False

        wait_for(answers, timeout_s=10, interval_s=0.05, message=f"redis-server on port {self.port}")
        return self

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


@pytest.fixture
def private_redis(tmp_path):
    server = PrivateRedis(_free_port(), tmp_path / "redis.log").start()
    yield server
    server.kill()


@pytest.mark.parametrize("lease_s", [3, DEFAULT_LEASE_S], ids=["lease-3s", "default-lease-15s"])
def test_a_launch_lost_with_its_worker_and_its_message_is_launched_again_once_its_lease_runs_out(
    lease_s, settings, tmp_path, private_redis, tenant, owner, record_property
):
    settings.CLUSTER_BACKEND_FACTORY = FACTORY_QUICK
    get_backend.cache_clear()
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    environment = ready_environment(actor=owner, tenant=tenant)
    common = dict(
        CELERY_BROKER_URL=private_redis.url, CLUSTER_BACKEND_FACTORY=FACTORY_QUICK, CHAOS_STEP_S=1,
        JOB_LAUNCH_LEASE_S=lease_s, SCHEDULER_CYCLE_INTERVAL_S=1, JOB_RECONCILE_INTERVAL_S=1,
        # Nothing comes back by the broker's own redelivery within the test: only the reconcile can help.
        CELERY_VISIBILITY_TIMEOUT_S=3600,
    )
    workers = [WorkerProcess(tmp_path / "worker-1.log", beat=True, CHAOS_LAUNCH_DELAY_S=600,
                             CHAOS_LAUNCH_DELAY_AFTER="true", **common)]
    try:
        workers[0].start()
        # The submit's kick goes to the suite's broker, where nobody listens for this test: the
        # private worker's beat runs the cycle, and the cycle sends the launch to the private Redis.
        job = jobs.job_submit(actor=owner, data=job_data(
            environment, replicas=1, gpus_per_replica=1, steps=3600, checkpoint_every_steps=0,
            topology={"level": "none", "mode": "required"}, max_runtime_s=7200,
        ))
        backend = get_backend()
        wait_for(lambda: Job.objects.get(id=job.id).state == "launching" and backend._read(job.id, 1) is not None,
                 timeout_s=60, message="the launch to have started the replicas (it then sleeps)")
        record = backend._read(job.id, 1)
        unacked = unacked_keys(settings.CELERY_TASK_DEFAULT_QUEUE)["unacked_key"]  # the worker's
        assert private_redis.client().hlen(unacked) >= 1, "the launch message is held unacknowledged"

        workers[0].kill()
        killed_at = time.monotonic()
        lease_until = job.attempts.get(number=1).launch_lease_until
        lease_left_s = (lease_until - timezone.now()).total_seconds()
        private_redis.kill()
        private_redis.start()
        assert private_redis.client().dbsize() == 0, "the restarted broker holds nothing: the launch message is lost"
        workers.append(WorkerProcess(tmp_path / "worker-2.log", beat=True, **common).start())
        started_s = time.monotonic() - killed_at

        wait_for(lambda: Job.objects.get(id=job.id).state == "running", timeout_s=lease_s + 60, interval_s=0.1,
                 message="the job to run after its launcher and its message were lost")
        figure = time.monotonic() - killed_at
        record_property(f"kill_to_running_s_lease_{lease_s}", round(figure, 2))
        print(f"\nlease {lease_s}s: {figure:.1f}s from the SIGKILL to running (the lease ran out {lease_left_s:.1f}s "
              f"after the kill; the new worker was up after {started_s:.1f}s)")

        job.refresh_from_db()
        attempts = list(job.attempts.order_by("number"))
        assert [(a.number, a.ended_at) for a in attempts] == [(1, None)], "the same attempt, never ended"
        assert attempts[0].started_at is not None and attempts[0].launch_lease_until is None
        assert backend._read(job.id, 1)["started"] == record["started"], "the replicas were not started twice"
        events = [event.to_state for event in job.events.order_by("at", "id")]
        assert events == ["queued", "admitted", "launching", "running"], events
        # Not before the lease ran out (the dead launcher renewed it up to a third of a lease before
        # it died), and not much after: one reconcile interval, a launch, and the worker's start-up.
        assert figure >= lease_s * 2 / 3 - 0.5
        assert figure <= max(lease_s, started_s) + 10, figure
    finally:
        for worker in workers:
            worker.stop()
