"""A request whose database connection dies before it wrote anything is run again once, on a fresh connection.

Through a real gunicorn on the test database. The test's own connection takes the jobs table's
ACCESS EXCLUSIVE lock, so the request blocks on its first query of that table; the test then
terminates the web server's backend that waits (``pg_terminate_backend``) and lets the lock go.
The request's connection died before anything of it was committed, so the portal runs it again
on a fresh connection and the client gets its answer, not a 503. A keyed submit so retried makes
its one job.
"""

import threading

import pytest
import requests

from runners.jobs.models import IdempotencyKey, Job, JobEvent
from tests.faults import support
from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment
from tests.support.worker import purge_queue, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def world(tmp_path, tenant, owner):
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    environment = ready_environment(actor=owner, tenant=tenant)
    web = support.Gunicorn(tmp_path / "web.log", workers=1).start()
    token = support.api_token(owner)
    # A token's first use writes its last_used_at: that request is not one that wrote nothing.
    assert requests.get(f"{web.url}/api/v1/jobs/", headers={"Authorization": f"Token {token}"}, timeout=30).ok
    yield web, environment, token
    web.stop()
    purge_queue()  # the kicks the server sent, which no worker here takes


def _waiting_backends() -> list[int]:
    with support.raw_connection(autocommit=True) as probe:
        return [row[0] for row in probe.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'faults-web' "
            "AND wait_event_type = 'Lock'").fetchall()]


def _call_while_its_connection_is_killed(method: str, url: str, **kwargs) -> requests.Response:
    """Send the request while the jobs table is locked; kill the backend it blocks in; release the lock."""
    answer = {}
    locker = support.raw_connection()
    try:
        locker.execute("LOCK TABLE runners_job IN ACCESS EXCLUSIVE MODE")
        thread = threading.Thread(target=lambda: answer.update(response=requests.request(method, url, timeout=60,
                                                                                          **kwargs)))
        thread.start()
        waiting = wait_for(_waiting_backends, timeout_s=30, interval_s=0.05, message="the request to wait on the lock")
        with support.raw_connection(autocommit=True) as killer:
            for pid in waiting:
                killer.execute("SELECT pg_terminate_backend(%s, 5000)", [pid])
    finally:
        locker.rollback()  # the lock goes
        locker.close()
    thread.join(60)
    return answer["response"]


def test_a_read_whose_connection_dies_is_answered_from_a_fresh_one(world):
    web, _environment, token = world
    response = _call_while_its_connection_is_killed("GET", f"{web.url}/api/v1/jobs/",
                                                    headers={"Authorization": f"Token {token}"})
    assert response.status_code == 200, (response.status_code, response.text[:500])
    assert "Database connection lost" in web.output()  # it did lose it: the one log line of the retry


def test_a_keyed_submit_whose_connection_dies_before_commit_is_made_once(world):
    web, environment, token = world
    body = support.submit_body(environment, "retried")
    response = _call_while_its_connection_is_killed(
        "POST", f"{web.url}/api/v1/jobs/", json=body, headers={"Authorization": f"Token {token}",
                                                               "Idempotency-Key": "retried-1"})
    assert response.status_code == 201, (response.status_code, response.text[:500])
    job = Job.objects.get()
    assert response.json()["id"] == job.id
    assert IdempotencyKey.objects.get().job_id == job.id
    assert JobEvent.objects.filter(job=job, to_state="queued").count() == 1
