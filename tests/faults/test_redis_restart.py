"""Redis killed and started again (empty) under real work: the API never answers 5xx, and every task's
effect happens exactly once.

A Redis of the test's own (no persistence) is the broker of a worker, a beat and a gunicorn web
server. Through the API: an environment and two jobs; Redis is SIGKILLed; while it is down, another
environment and two more jobs are asked for (each answers 201, saying degraded: the write
committed, the send failed) and the lists are read (200); Redis comes back empty, so whatever it
held is gone too. The beat's sweeps send again what was never sent or was lost. In the end both
environments are ready, each provisioned by one run of its task, and every job succeeded on its
one attempt, its replicas started once.
"""

import time

import pytest
import requests

from runners.clusters.registry import get_backend
from runners.environments.models import Environment
from runners.jobs.models import Job, JobAttempt, JobEvent
from tests.faults import support
from tests.support import invariants
from tests.support.jobs import demo_cluster_with_flavors, give_quota
from tests.support.worker import WorkerProcess, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def test_the_broker_lost_and_back_loses_nothing_and_doubles_nothing(settings, tmp_path, tenant, owner):
    settings.CLUSTER_BACKEND_FACTORY = support.FACTORY
    get_backend.cache_clear()
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    base = invariants.baseline()
    broker = support.PrivateRedis(tmp_path / "redis.log").start()
    trace = tmp_path / "trace.log"
    common = dict(
        CELERY_BROKER_URL=broker.url, CLUSTER_BACKEND_FACTORY=support.FACTORY, CHAOS_STEP_S=0.05,
        SCHEDULER_CYCLE_INTERVAL_S=1, JOB_RECONCILE_INTERVAL_S=1, JOB_LAUNCH_LEASE_S=3, JOB_LAUNCH_RESEND_AFTER_S=2,
        SWEEP_INTERVAL_S=2, STUCK_AFTER_S=4, ENDPOINT_RECONCILE_INTERVAL_S=30, USAGE_SAMPLE_INTERVAL_S=30,
        FAULTS_TRACE=trace, LOCAL_PROVISION_DELAY_S=0.5,
    )
    session = requests.Session()
    session.headers["Authorization"] = f"Token {support.api_token(owner)}"
    web = support.Gunicorn(tmp_path / "web.log", **common)
    the_beat = support.beat(tmp_path / "beat.log", PGAPPNAME="faults-beat", **common)
    worker = WorkerProcess(tmp_path / "worker.log", PGAPPNAME="faults-worker", **common)
    answers = []

    def call(method, path, **kwargs):
        response = session.request(method, f"{web.url}{path}", timeout=30, **kwargs)
        answers.append((method, path, response.status_code, response.headers.get("X-Portal-Degraded", "")))
        assert response.status_code < 500, (method, path, response.status_code, response.text[:500])
        return response

    def submit(environment_id, name):
        body = support.submit_body(Environment.objects.get(id=environment_id), name)
        response = call("POST", "/api/v1/jobs/", json=body, headers={"Idempotency-Key": support.new_key()})
        assert response.status_code == 201, response.text
        return response.json()["id"]

    try:
        web.start()
        worker.start()
        the_beat.start(ready=b"beat: Starting")
        before = call("POST", "/api/v1/environments/", json={"tenant": tenant.slug, "name": "before"}).json()["id"]
        wait_for(lambda: Environment.objects.get(id=before).state == "ready", timeout_s=30,
                 message="the first environment to be ready")
        job_ids = [submit(before, "up-1"), submit(before, "up-2")]

        broker.kill()
        during = call("POST", "/api/v1/environments/", json={"tenant": tenant.slug, "name": "during"})
        assert during.status_code == 201 and "broker-unreachable" in during.headers.get("X-Portal-Degraded", "")
        during = during.json()["id"]
        job_ids += [submit(before, "down-1"), submit(before, "down-2")]
        assert call("GET", "/api/v1/jobs/").status_code == 200
        assert call("GET", f"/api/v1/environments/{during}/").status_code == 200
        time.sleep(2)
        broker.start()  # the same port, empty

        wait_for(lambda: Environment.objects.filter(id__in=[before, during], state="ready").count() == 2,
                 timeout_s=45, message="both environments to be ready")
        wait_for(lambda: Job.objects.filter(id__in=job_ids, state="succeeded").count() == len(job_ids),
                 timeout_s=60, message="every job to succeed")
    finally:
        the_beat.stop()
        worker.stop()
        web.stop()
        broker.kill()

    assert [status for _, _, status, _ in answers if status >= 500] == []
    runs = dict(Environment.objects.filter(id__in=[before, during]).values_list("id", "task_runs"))
    assert runs == {before: 1, during: 1}, f"each environment provisioned by one run of its task: {runs}"
    built = [int(line[3]) for line in support.trace_lines(trace) if line[2] == "environment"]
    assert sorted(built) == sorted([before, during]), f"each environment built once: {built}"
    problems = invariants.check(get_backend(), baseline=base, stuck_after_s=30)
    assert problems == [], problems
    for job_id in job_ids:
        assert list(JobAttempt.objects.filter(job_id=job_id).values_list("number", "outcome")) == [(1, "succeeded")], \
            invariants.describe([job_id])
        events = list(JobEvent.objects.filter(job_id=job_id).order_by("at", "id").values_list("to_state", flat=True))
        assert events == ["queued", "admitted", "launching", "running", "succeeded"], (job_id, events)
    created = sorted(int(line[3]) for line in support.trace_lines(trace) if line[2] == "launch" and line[5] == "created")
    assert created == sorted(job_ids), "each job's replicas were started once"
