"""Redis restarted several times in a row: every worker is still consuming after each restart.

Two workers run as `manage.py up` runs one (two pool processes each), on a Redis of the test's own.
Before each restart every worker is in the middle of a slow environment provision (an acks_late
task, so its message is held unacknowledged) with its other pool process free, so it is also
waiting on a BRPOP: the state in which a worker exited with ``Unrecoverable error:
AttributeError("'NoneType' object has no attribute 'hostname'")``. The worker notices the lost
broker on whichever socket fails first; when it is the pub/sub one (remote control) while the
BRPOP is pending, kombu's teardown left the consumer's channel half-closed and its second close,
after the transport was let go, crashed (portal.celery.PortalConsumer). A real restart hits that
order about one time in three; here the pub/sub connections are closed a moment before Redis is
killed, so it happens each time.

After each restart, each worker must run a task sent to its own queue.

The suite runs the short form, two restarts (the crash came on the first restart whose order was
right, and this order is forced on each; a second shows a worker back from one restart survives the
next). The long form restarts as often as asked: ``BROKER_RESTARTS=5`` (or more) on this file, or
``bench/long_tests.sh broker [N]``.
"""

import itertools
import os
import sys
import time

import pytest
import redis
from celery import Celery
from django.conf import settings

from runners.environments import services as environments
from runners.environments.models import Environment
from tests.faults import support
from tests.support.worker import purge_queue, wait_for, worker_environment

pytestmark = [pytest.mark.e2e, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

RESTARTS = int(os.environ.get("BROKER_RESTARTS", "2"))
WORKERS = 2
PROVISION_S = 8  # long enough that the provision is still running when Redis is back


def _send(broker_url: str, name: str, *args, queue: str) -> str:
    """Publish one task message to ``queue`` on the test's Redis, from a connection of its own."""
    app = Celery("faults-sender", set_as_current=False)  # (CELERY_BROKER_URL in the environment would win over broker=)
    try:
        with app.connection_for_write(broker_url, connect_timeout=2) as connection:
            return app.send_task(name, args=args, queue=queue, connection=connection).id
    finally:
        app.close()


def _ran(worker: support.Process, task_id: str) -> bool:
    if worker.process.poll() is not None:
        raise AssertionError(f"the worker exited ({worker.process.returncode}):\n{worker.output()[-4000:]}")
    return f"[{task_id}] succeeded" in worker.output()


def _consumes(worker: support.Process, queue: str, broker_url: str, timeout_s: float = 60) -> bool:
    """Whether the worker runs a task sent to its own queue; sent again every few seconds (the first may
    go out before the worker has declared its queue on the empty Redis)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            probe = _send(broker_url, "runners.tasks.jobs_reconcile", queue=queue)
        except Exception:  # the broker not reachable yet from here either
            time.sleep(1)
            continue
        resend_at = time.monotonic() + 5
        while time.monotonic() < resend_at:
            if _ran(worker, probe):
                return True
            time.sleep(0.2)
    return False


def _provision_started(worker: support.Process, task_id: str, environment_id: int) -> bool:
    return f"[{task_id}] received" in worker.output() and Environment.objects.get(id=environment_id).task_runs >= 1


def test_broker_restarts_leave_every_worker_consuming(tmp_path, tenant, owner):
    broker = support.PrivateRedis(tmp_path / "redis.log").start()
    queues = [f"{settings.CELERY_TASK_DEFAULT_QUEUE}-probe-{index}" for index in range(WORKERS)]
    env = dict(CELERY_BROKER_URL=broker.url, CLUSTER_BACKEND_FACTORY=support.FACTORY,
               LOCAL_PROVISION_DELAY_S=PROVISION_S)
    workers = [
        support.Process(
            [sys.executable, "-m", "celery", "-A", "portal", "worker", "-l", "INFO", "--concurrency", "2",
             "-Q", f"{settings.CELERY_TASK_DEFAULT_QUEUE},{queue}", "--hostname", f"{queue}@%h"],
            tmp_path / f"worker-{index}.log", worker_environment(PGAPPNAME=f"faults-worker-{index}", **env),
        )
        for index, queue in enumerate(queues)
    ]
    names = (f"slow-{n}" for n in itertools.count())
    try:
        for worker in workers:
            worker.start(ready=b"ready.")
        for restart in range(1, RESTARTS + 1):
            # Each worker provisions an environment slowly: one message held unacknowledged, a BRPOP pending.
            for worker, queue in zip(workers, queues):
                environment = environments.environment_request(actor=owner, tenant=tenant, name=next(names))
                task_id = _send(broker.url, "runners.tasks.environment_provision", environment.id, queue=queue)
                wait_for(lambda w=worker, t=task_id, e=environment.id: _provision_started(w, t, e), timeout_s=30,
                         message=f"the slow provision to start before restart {restart}")

            # The restart: the pub/sub connections go first, then Redis itself; it comes back empty.
            redis.Redis.from_url(broker.url).client_kill_filter(_type="pubsub")
            broker.kill()
            time.sleep(1)
            broker.start()

            for index, (worker, queue) in enumerate(zip(workers, queues)):
                assert _consumes(worker, queue, broker.url), f"worker {index} is not consuming after restart {restart}"
    finally:
        for worker in workers:
            worker.stop()
        broker.kill()
        purge_queue()  # the provisions the test's own broker was asked for

    for index, worker in enumerate(workers):
        assert "Unrecoverable error" not in worker.output(), f"worker {index}:\n{worker.output()[-4000:]}"
