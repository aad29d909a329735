"""Notifications with a real Celery worker: the receivers enqueue after commit, the worker records the event,
delivers it signed, retries a failing receiver with exponential backoff, gives up after the last attempt,
and a delivery whose worker was killed mid-try is delivered by another."""

import json
import subprocess
import time
from pathlib import Path

import pytest
import redis
from django.conf import settings

from portal.settings import unacked_keys
from runners.jobs import attempts
from runners.jobs import services as jobs
from runners.notifications import services
from runners.notifications.models import Delivery, Event
from runners.scheduling import services as scheduling
from tests.notifications.hooks import HookReceiver, signed_by
from tests.support.backends import use_backend
from tests.support.jobs import give_quota, job_data
from tests.support.worker import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

BACKOFF_S = 0.4


def _finish_a_job(environment, owner, outcome="succeeded", name="train-1"):
    """Submit, admit, launch and end a job through the jobs app's services, each step committed."""
    job = jobs.job_submit(actor=owner, data=job_data(environment, name=name, replicas=1, topology={"level": "none"},
                                                    max_retries=0))
    scheduling.cycle_run()
    attempt = job.attempts.get()
    attempts.job_launch_run(job_id=job.id, attempt_number=attempt.number)
    assert attempts.attempt_end(job.id, attempt.id, outcome=outcome, reason=f"Replica 0 {outcome}.")
    job.refresh_from_db()
    return job


def _broker_state() -> str:
    """What Redis holds for this run's queue: the waiting messages and the unacknowledged ones (with their age)."""
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    keys = unacked_keys(queue)
    index = client.zrange(keys["unacked_index_key"], 0, -1, withscores=True)
    return (f"queue {queue}: {client.llen(queue)} waiting; unacknowledged: "
            f"{[(tag.decode(), round(time.time() - score, 1)) for tag, score in index]}; "
            f"restore lock: {client.get(keys['unacked_mutex_key'])}; "
            f"bindings: {client.smembers('_kombu.binding.' + queue)}; consumers: {_consumers(queue)}")


def _sender(hook) -> str:
    """Which process holds the connection the receiver is holding (ss, where it is installed)."""
    try:
        port = hook.server.server_address[1]
        return subprocess.run(["ss", "-tnpH", "dst", f"127.0.0.1:{port}"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as error:
        return f"unknown ({error})"


def _consumers(queue: str) -> list[str]:
    """The processes started for this queue (CELERY_QUEUE in their environment) that are still there."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"CELERY_QUEUE={queue}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append(f"{proc.name}: {(proc / 'cmdline').read_bytes().replace(bytes(1), b' ')[:160].decode()}")
        except OSError:
            pass
    return found


@pytest.fixture
def cluster(settings, acme_env, flavors, tenant):
    use_backend(settings, "quick_jobs")
    settings.NOTIFY_WEBHOOK_ALLOW_PRIVATE = True  # the receivers are on loopback
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16)
    return acme_env


def test_a_finished_job_reaches_a_flaky_receiver_after_backoff_and_a_dead_one_is_given_up(
    cluster, celery_worker_factory, tenant, owner
):
    celery_worker_factory(NOTIFY_WEBHOOK_BACKOFF_S=BACKOFF_S, NOTIFY_WEBHOOK_MAX_ATTEMPTS=3, NOTIFY_WEBHOOK_ALLOW_PRIVATE=True)
    with HookReceiver(fail_first=2) as flaky, HookReceiver(fail_first=99) as dead:
        good = services.webhook_create(actor=owner, tenant=tenant, url=flaky.url, events=["job_finished"])
        bad = services.webhook_create(actor=owner, tenant=tenant, url=dead.url, events=["job_finished", "job_failed"])
        job = _finish_a_job(cluster, owner)
        assert job.state == "succeeded"

        wait_for(lambda: flaky.delivered(), timeout_s=60, message="the flaky receiver to get it on its third try")
        wait_for(lambda: Delivery.objects.filter(webhook=bad, state="failed").exists(), timeout_s=60,
                 message="the dead receiver's delivery to be given up")

    assert [item.answered for item in flaky.received] == [500, 500, 204]
    gaps = [b.at - a.at for a, b in zip(flaky.received, flaky.received[1:])]
    assert gaps[0] >= BACKOFF_S and gaps[1] >= 2 * BACKOFF_S, f"exponential backoff: {gaps}"
    assert len({item.body for item in flaky.received}) == 1, "every try sends the same body"
    assert all(signed_by(good.secret, item) for item in flaky.received)
    body = json.loads(flaky.received[-1].body)
    assert body["event"] == "job_finished" and body["tenant"] == "acme" and body["object"]["id"] == job.id

    event = Event.objects.get()
    assert event.key == f"job:{job.id}:succeeded"
    delivered = Delivery.objects.get(webhook=good)
    assert (delivered.state, delivered.attempts, delivered.status_code, delivered.error) == ("delivered", 3, 204, "")
    assert flaky.received[-1].headers["X-Portal-Delivery"] == str(delivered.id)
    given_up = Delivery.objects.get(webhook=bad)
    assert (given_up.state, given_up.attempts, given_up.status_code) == ("failed", 3, 500)
    assert given_up.error == "Answered 500." and given_up.next_try_at is None
    assert len(dead.received) == 3


def test_a_delivery_whose_worker_dies_mid_try_is_delivered_by_another(cluster, celery_worker_factory, tenant, owner):
    """The worker is killed while the receiver holds its POST: the message was not acknowledged (acks
    late), so Redis hands it to the next worker once the claim of the dead try has run out."""
    fast = dict(NOTIFY_WEBHOOK_TIMEOUT_S=20, CELERY_VISIBILITY_TIMEOUT_S=2, CELERY_UNACKED_RESTORE_INTERVAL_S=1,
                NOTIFY_WEBHOOK_ALLOW_PRIVATE=True)
    first = celery_worker_factory(**fast)
    with HookReceiver() as hook:
        webhook = services.webhook_create(actor=owner, tenant=tenant, url=hook.url, events=["job_failed"])
        hook.hold_first = True
        job = _finish_a_job(cluster, owner, outcome="failed")
        assert job.state == "failed"
        wait_for(lambda: hook.held.is_set(), timeout_s=60, message="the first try to reach the receiver")
        sender = _sender(hook)
        first.kill()
        delivery = Delivery.objects.get(webhook=webhook)
        assert delivery.state == "pending" and delivery.attempts == 0
        # Past the dead try's claim (timeout + margin), as a restart some time later would find it.
        Delivery.objects.filter(id=delivery.id).update(next_try_at=delivery.created_at)
        hook.release.set()
        second = celery_worker_factory(**fast)
        try:
            wait_for(lambda: Delivery.objects.filter(id=delivery.id, state="delivered").exists(), timeout_s=60,
                     message="another worker to deliver it")
        except AssertionError as timed_out:
            raise AssertionError(f"{timed_out}\n{_broker_state()}\nheld try sent by: {sender} (first worker: "
                                 f"{first.process.pid})\nfirst worker:\n{first.output()[-3000:]}\n"
                                 f"second worker:\n{second.output()[-3000:]}") from None
    delivery.refresh_from_db()
    assert delivery.attempts == 1 and delivery.status_code == 204
    assert signed_by(webhook.secret, hook.delivered()[-1])
