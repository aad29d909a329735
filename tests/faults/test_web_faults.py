"""The web tier under faults: database connections dropped under load, and a web worker killed mid-request.

Both run a real gunicorn (two sync workers) on the test database, its connections named with
PGAPPNAME, and client threads that submit jobs (each with its own Idempotency-Key) and read lists.

- Connections dropped: a thread terminates every database connection of the web server
  (``pg_terminate_backend``) several times a second. A connection that died between requests is
  replaced before use (CONN_HEALTH_CHECKS); one that dies mid-request answers 503 with
  Retry-After, the request's transaction rolled back. A client retries once after a 503 or a
  connection error: no 500 ever reaches it, and most requests succeed.
- A worker killed: SIGKILL, mid-request, of one of the two workers, again and again (gunicorn
  starts another). The client retries with the same Idempotency-Key until it gets an answer.

Either way each key made exactly one job, every job is whole (its queued event and its key row,
written in its one transaction) and the job invariants hold.
"""

import contextlib
import os
import random
import signal
import threading
import time
from collections import Counter

import pytest
import requests

from runners.jobs.models import IdempotencyKey, Job, JobEvent
from tests.faults import support
from tests.support import invariants
from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment
from tests.support.worker import purge_queue

pytestmark = [pytest.mark.e2e, pytest.mark.worker, pytest.mark.django_db(transaction=True)]

RUN_S = 10


@pytest.fixture
def portal(settings, tmp_path, tenant, owner):
    """A ready environment with quota, and an API token of its owner."""
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    environment = ready_environment(actor=owner, tenant=tenant)
    purge_queue()
    yield environment, support.api_token(owner)
    purge_queue()  # the kicks the server sent, which no worker here takes


def _client(web, token, template: dict, calls: support.Calls, stop: threading.Event, *, seed: int, retries: int,
            submit_share: float):
    rng = random.Random(seed)
    session = requests.Session()
    session.headers["Authorization"] = f"Token {token}"
    while not stop.is_set():
        key = None
        if rng.random() < submit_share:
            key = support.new_key()
            method, path = "POST", "/api/v1/jobs/"
            kwargs = {"json": {**template, "name": f"job-{key[:8]}"}, "headers": {"Idempotency-Key": key}}
        else:
            method, path, kwargs = "GET", rng.choice(["/api/v1/jobs/", "/api/v1/environments/"]), {}
        seen = []
        for _ in range(retries + 1):
            try:
                response = session.request(method, f"{web.url}{path}", timeout=30, **kwargs)
                status, body = response.status_code, response
            # A server gone before its answer (or mid-answer: the body cut short), or a client that gave up
            # waiting: each retries with the same key.
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError):
                session = requests.Session()
                session.headers["Authorization"] = f"Token {token}"
                status, body = "connection", None
            seen.append(status)
            if status not in (502, 503, "connection"):
                break
            if status == 503:
                assert body.headers.get("Retry-After"), "a 503 says when to come back"
            time.sleep(0.1)
        job_id = body.json().get("id") if method == "POST" and status in (200, 201) else None
        calls.add(method=method, key=key, seen=seen, status=status, job_id=job_id)


def _run_clients(web, token, environment, *, count, retries, submit_share, fault, until=None) -> support.Calls:
    """``count`` client threads for RUN_S seconds beside the ``fault`` thread; with ``until`` (a test of the calls
    so far), on past RUN_S until it holds, for at most three times as long: a fault that struck nothing in flight
    in the first seconds (a worker killed just after its answer) is applied until it does."""
    calls, stop = support.Calls(), threading.Event()
    template = support.submit_body(environment, "job")  # read here: the client threads use no database connection
    crashed: list[BaseException] = []

    def client(**kwargs):
        try:
            _client(web, token, template, calls, stop, **kwargs)
        except BaseException as error:  # a client that dies takes its last submit's record with it: say so
            crashed.append(error)
            raise

    threads = [threading.Thread(target=client, kwargs=dict(seed=index, retries=retries, submit_share=submit_share))
               for index in range(count)]
    faults = threading.Thread(target=fault, args=(stop,))
    for thread in [*threads, faults]:
        thread.start()
    time.sleep(RUN_S)
    deadline = time.monotonic() + 2 * RUN_S
    while until is not None and time.monotonic() < deadline:
        with calls.lock:
            if until(calls.rows):
                break
        time.sleep(0.2)
    stop.set()
    for thread in [*threads, faults]:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a client still waits: its last submit is not recorded"
    assert not crashed, f"a client died, its last submit not recorded: {crashed!r}"
    return calls


def _each_key_made_one_whole_job(calls: support.Calls) -> None:
    posts = [row for row in calls.rows if row["method"] == "POST"]
    answered = {row["key"]: row["job_id"] for row in posts if row["status"] in (200, 201)}
    keys = dict(IdempotencyKey.objects.filter(key__in=[row["key"] for row in posts]).values_list("key", "job_id"))
    for key, job_id in answered.items():
        assert keys.get(key) == job_id, f"key {key} answered job {job_id}, but the key names {keys.get(key)}"
    jobs = list(Job.objects.values_list("id", flat=True))
    assert sorted(keys.values()) == sorted(jobs), "every job is one key's, and no key made two"
    queued = Counter(JobEvent.objects.filter(to_state="queued").values_list("job_id", flat=True))
    assert all(queued[job_id] == 1 for job_id in jobs), "every job has its one queued event"
    problems = invariants.check(None, stuck_after_s=600)
    assert problems == [], problems


def test_database_connections_dropped_under_load_never_reach_a_client_as_500(portal, tmp_path, record_property):
    environment, token = portal
    # As the portal runs it (portal/gunicorn_conf.py): threaded workers, each thread its own connection.
    web = support.Gunicorn(tmp_path / "web.log", threads=4, JOB_QUEUED_MAX_PER_TENANT=100000).start()
    killer = support.raw_connection(autocommit=True)
    terminated = []

    def drop_connections(stop):
        while not stop.is_set():
            row = killer.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() AND application_name = 'faults-web'"
            ).fetchone()
            terminated.append(row[0])
            stop.wait(0.3)

    try:
        calls = _run_clients(web, token, environment, count=3, retries=1, submit_share=0.4, fault=drop_connections)
    finally:
        killer.close()
        web.stop()

    statuses = Counter(row["status"] for row in calls.rows)
    first_tries = Counter(row["seen"][0] for row in calls.rows)
    hit = sum(1 for row in calls.rows if row["seen"][0] in (503, "connection"))
    record_property("answers", dict(statuses))
    print(f"\n{len(calls.rows)} requests, {sum(terminated)} connections terminated; first tries {dict(first_tries)}; "
          f"after the retry {dict(statuses)}")
    assert sum(terminated) >= 10, "the fault was applied"
    assert hit >= 1, "some request lost its connection mid-way (else this test proves nothing)"
    assert all(500 not in row["seen"] for row in calls.rows), [row for row in calls.rows if 500 in row["seen"]]
    assert set(statuses) <= {200, 201, 503}, statuses
    assert statuses[200] + statuses[201] >= 0.7 * len(calls.rows), statuses
    _each_key_made_one_whole_job(calls)


def test_a_web_worker_killed_mid_request_leaves_each_submit_made_once_and_whole(portal, tmp_path, record_property):
    environment, token = portal
    # Sync workers: a worker holding a client's connection is in the middle of that request.
    web = support.Gunicorn(tmp_path / "web.log", JOB_QUEUED_MAX_PER_TENANT=100000).start()
    killed = []

    def kill_workers(stop):
        rng = random.Random(7)
        while not stop.wait(0.02):
            busy = web.busy_workers()
            if not busy:
                continue
            pid = rng.choice(busy)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            stop.wait(2.5)  # gunicorn boots another; the other worker serves meanwhile

    try:
        calls = _run_clients(web, token, environment, count=3, retries=30, submit_share=0.8, fault=kill_workers,
                             until=lambda rows: any(row["method"] == "POST" and "connection" in row["seen"]
                                                    for row in rows))
    finally:
        web.stop()

    posts = [row for row in calls.rows if row["method"] == "POST"]
    retried = [row for row in posts if len(row["seen"]) > 1]
    record_property("workers_killed", len(killed))
    print(f"\n{len(calls.rows)} requests ({len(posts)} submits, {len(retried)} retried), {len(killed)} workers killed; "
          f"answers {dict(Counter(row['status'] for row in calls.rows))}")
    assert len(killed) >= 3, "the fault was applied"
    assert any("connection" in row["seen"] for row in posts), "a submit lost its server mid-way"
    assert all(row["status"] in (200, 201) for row in calls.rows), [row for row in calls.rows
                                                                   if row["status"] not in (200, 201)]
    assert all(500 not in row["seen"] for row in calls.rows)
    _each_key_made_one_whole_job(calls)
