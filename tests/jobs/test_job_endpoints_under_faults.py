"""Every job endpoint, with the cluster failing at one call at a time, and with the database's
connections cut under load: never a 500, never a job the client was not told of, never two for one key.

The first test walks the backend's job calls one by one (each failing alone, transient and
permanent in turn) through every job endpoint of the API and the pages, so a call that some
request still makes turns up as the one that fails it. The second submits from several clients at
once while another connection terminates theirs, and retries each submit under its Idempotency-Key
until it is answered.
"""

from __future__ import annotations

import random
import threading
import time
import uuid

import pytest
from django.db import close_old_connections, connection
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from runners.backends.base import PermanentBackendError, TransientBackendError
from runners.jobs import services as jobs
from runners.jobs.models import IdempotencyKey, Job, JobAttempt, JobState
from runners.scheduling import services as scheduling
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment

pytestmark = pytest.mark.integration

ONE_GPU = {"replicas": 1, "gpus_per_replica": 1, "topology": {"level": "none", "mode": "preferred"}}

# Every call the ClusterBackend protocol has for jobs (runners/backends/base.py).
JOB_CALLS = ("launch_job", "job_status", "stop_job", "kill_job", "forget_job", "jobs_open", "job_logs",
             "job_progress")
ERRORS = {
    "transient": TransientBackendError("connection refused"),
    "permanent": PermanentBackendError("jobs.batch is forbidden"),
}


@pytest.fixture
def acme_env(db, tenant, owner):
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16)
    return ready_environment(actor=owner, tenant=tenant)


def _running_without_processes(actor, environment, name: str) -> Job:
    """A job the portal holds as running (its attempt started), with nothing on the cluster."""
    job = jobs.job_submit(actor=actor, data=job_data(environment, name=name, **ONE_GPU))
    scheduling.cycle_run()
    job.refresh_from_db()
    assert job.state == JobState.ADMITTED, job.reason
    assert jobs.transition(job, JobState.LAUNCHING, "test: claimed")
    JobAttempt.objects.filter(job=job, ended_at__isnull=True).update(started_at=timezone.now())
    assert jobs.transition(job, JobState.RUNNING, "test: started")
    return job


def _requests(job: Job, environment, tenant_slug: str, other: Job):
    """(what, method, path, data) for every job endpoint; ``other`` is a job the cancels may stop."""
    form = job_data(environment, name="from-the-page", **ONE_GPU)
    return [
        ("api list", "get", "/api/v1/jobs/", None),
        ("api list filtered", "get", "/api/v1/jobs/?state=running", None),
        ("api detail", "get", f"/api/v1/jobs/{job.id}/", None),
        ("api submit", "post", "/api/v1/jobs/", job_data(environment, name="from-the-api", **ONE_GPU)),
        ("api logs", "get", f"/api/v1/jobs/{job.id}/logs/?tail=50", None),
        ("api metrics", "get", f"/api/v1/jobs/{job.id}/metrics/", None),
        ("api cancel", "post", f"/api/v1/jobs/{other.id}/cancel/", None),
        ("page list", "get", f"/tenants/{tenant_slug}/jobs/", None),
        ("page detail", "get", f"/jobs/{job.id}/", None),
        ("page live", "get", f"/jobs/{job.id}/live/", None),
        ("page submit form", "get", f"/tenants/{tenant_slug}/jobs/new/", None),
        ("page submit", "post", f"/tenants/{tenant_slug}/jobs/new/", {
            "environment": form["environment"], "name": form["name"], "flavor": form["flavor"],
            "replicas": 1, "gpus_per_replica": 1, "cpu_milli_per_replica": 2000, "memory_mib_per_replica": 4096,
            "priority": 0, "steps": 200, "checkpoint_every_steps": 50, "max_runtime_s": 600, "max_retries": 1,
            "preemptible": "on",
            "topology_level": "none", "topology_mode": "preferred",
        }),
        ("page cancel", "post", f"/jobs/{job.id}/cancel/", None),
    ]


@pytest.mark.django_db
@pytest.mark.parametrize("kind", sorted(ERRORS))
@pytest.mark.parametrize("failing_call", JOB_CALLS)
def test_no_job_endpoint_answers_500_whichever_backend_call_raises(
    failing_call, kind, owner, tenant, acme_env, faulty, client_for
):
    """One backend call raises, every other works; each endpoint answers what it would otherwise
    (2xx, 3xx or a 4xx of its own), or a 503 with Retry-After where it must read the cluster (the
    logs). The test clients raise whatever a view lets escape, so a 500 cannot hide."""
    job = _running_without_processes(owner, acme_env, "observed")
    other = _running_without_processes(owner, acme_env, "cancelled-by-the-api")
    faulty[failing_call] = ERRORS[kind]
    api = client_for(owner)
    browser = Client()
    browser.force_login(owner)

    answers = {}
    for what, method, path, data in _requests(job, acme_env, tenant.slug, other):
        client = api if what.startswith("api") else browser
        kwargs = {"format": "json"} if client is api and data is not None else {}
        response = getattr(client, method)(path, data, **kwargs) if data is not None else getattr(client, method)(path)
        answers[what] = response.status_code
        assert response.status_code < 500 or response.status_code == 503, (what, failing_call, response.content[:400])
        if response.status_code == 503:
            assert what == "api logs" and failing_call == "job_logs", (what, failing_call, response.content[:400])
            assert response["Retry-After"]
            assert "local" in response.json()["detail"]

    assert answers["api submit"] == 201 and answers["api cancel"] == 202, answers
    assert answers["page submit"] == 302 and answers["page cancel"] == 302, answers
    assert answers["api logs"] == (503 if failing_call == "job_logs" else 200), answers
    assert set(Job.objects.values_list("name", flat=True)) >= {"from-the-api", "from-the-page"}
    assert Job.objects.get(id=other.id).state == JobState.CANCELLING
    assert Job.objects.get(id=job.id).state == JobState.CANCELLING


def _terminator(stop: threading.Event, spare: set[int], killed: list[int]) -> None:
    """Terminate this database's other client connections every few hundred milliseconds at random."""
    try:
        while not stop.is_set():
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND backend_type = 'client backend' "
                    "AND pid <> pg_backend_pid() AND NOT (pid = ANY(%s))",
                    [list(spare)],
                )
                killed.append(sum(1 for (done,) in cursor.fetchall() if done))
            time.sleep(random.uniform(0.05, 0.4))
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_submits_with_database_connections_terminated_never_see_500_and_keys_never_make_two_jobs(
    owner, acme_env, client_for
):
    """Six clients submit eight jobs each, each under its own Idempotency-Key, retrying a 503 (or a
    dropped answer) with the same key and body, while another connection keeps terminating theirs.
    Every submit ends answered 201 or 200 naming one job; no answer is a 500; exactly one job exists
    per key, and none without a key that was answered."""
    clients, per_client = 6, 8
    data = {c: [job_data(acme_env, name=f"c{c}-j{n}", **ONE_GPU) for n in range(per_client)] for c in range(clients)}
    token_clients = [client_for(owner) for _ in range(clients)]
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        spare = {cursor.fetchone()[0]}

    seen: dict[str, list[int]] = {}
    named: dict[str, set[int]] = {}
    escaped: list[str] = []
    lock = threading.Lock()

    def submitter(index: int) -> None:
        api: APIClient = token_clients[index]
        try:
            for body in data[index]:
                key = f"{body['name']}-{uuid.uuid4()}"
                for _ in range(200):
                    close_old_connections()  # what a real server does before each request
                    try:
                        response = api.post("/api/v1/jobs/", body, format="json", HTTP_IDEMPOTENCY_KEY=key)
                    except Exception as exc:  # a view let it escape: the 500 a client would see
                        with lock:
                            escaped.append(f"{body['name']}: {type(exc).__name__}: {exc}")
                        connection.close()
                        continue
                    with lock:
                        seen.setdefault(body["name"], []).append(response.status_code)
                    if response.status_code in (200, 201):
                        with lock:
                            named.setdefault(body["name"], set()).add(response.json()["id"])
                        break
                    assert response.status_code == 503, (body["name"], response.status_code, response.content[:300])
                    assert response["Retry-After"]
                else:
                    raise AssertionError(f"{body['name']} was never answered")
        finally:
            connection.close()

    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_terminator, args=(stop, spare, killed), daemon=True)
    killer.start()
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            submitter(index)
        except BaseException as exc:  # handed to the test below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    stop.set()
    killer.join(30)

    assert not errors, errors
    assert not escaped, escaped[:5]
    assert sum(killed) > 0, "no connection was terminated: the test proved nothing"
    unavailable = sum(codes.count(503) for codes in seen.values())
    assert unavailable > 0, "no submit met a terminated connection: the test proved nothing"
    assert all(500 not in codes for codes in seen.values())

    names = [body["name"] for bodies in data.values() for body in bodies]
    assert sorted(named) == sorted(names)
    assert all(len(ids) == 1 for ids in named.values()), {n: ids for n, ids in named.items() if len(ids) > 1}
    stored = dict(Job.objects.filter(name__in=names).values_list("name", "id"))
    assert len(stored) == Job.objects.filter(name__in=names).count() == len(names), "a key made a second job"
    assert {name: next(iter(ids)) for name, ids in named.items()} == stored
    assert IdempotencyKey.objects.filter(job__name__in=names).count() == len(names)
