"""GET /metrics: queue and allocation from the database, the cycle's and the workers' counters from Redis
(recorded in whichever process did the work), for staff and the scrape token only.

The counters live in this run's Redis under this run's queue name and other tests add to them too,
so every check of a counter compares a scrape before with one after.
"""

import logging

import pytest
from django.test import Client
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

from common.metrics import metrics_collect
from portal.celery import app
from runners.jobs import services as jobs
from runners.jobs.models import JobState
from runners.scheduling import services as scheduling
from tests.support.jobs import give_quota, submit
from tests.support.worker import wait_for

pytestmark = pytest.mark.e2e

UNREACHABLE = "redis://127.0.0.1:9/0"  # the discard port: nothing listens there
SCRAPE_TOKEN = "scrape-token-for-the-metrics-tests"


def _scrape(client) -> dict[tuple[str, frozenset], float]:
    """Every sample of a 200 scrape, by (sample name, labels)."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.content.decode())
        for sample in family.samples
    }


def _value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)






@pytest.mark.django_db
def test_a_cycle_moves_queue_allocation_admissions_and_the_cycle_histogram(
    flavors, tenant, other_tenant, owner, outsider, acme_env, globex_env, staff, client_for
):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=8)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=2, max=2)
    submit(owner, acme_env, name="first", replicas=2, gpus_per_replica=2)
    submit(owner, acme_env, name="second", replicas=2, gpus_per_replica=4)  # past acme's max once first runs
    submit(outsider, globex_env, name="one", replicas=1, gpus_per_replica=2)
    submit(outsider, globex_env, name="two", replicas=1, gpus_per_replica=2)  # past globex's max
    client = client_for(staff)

    before = _scrape(client)
    for slug in ("acme", "globex"):
        assert _value(before, "portal_jobs_queued", tenant=slug, flavor="h100-80gb") == 2
        assert ("portal_gpu_units_allocated", frozenset({"tenant": slug, "flavor": "h100-80gb"}.items())) in before, (
            "a tenant with a quota is listed at 0, not left out"
        )
        assert _value(before, "portal_gpu_units_allocated", tenant=slug, flavor="h100-80gb") == 0
    assert _value(before, "portal_metrics_store_up") == 1

    result = scheduling.cycle_run()
    assert len(result["admitted"]) == 2 and len(result["waiting"]) == 2

    after = _scrape(client)
    for slug, units in (("acme", 4), ("globex", 2)):
        assert _value(after, "portal_jobs_queued", tenant=slug, flavor="h100-80gb") == 1
        assert _value(after, "portal_gpu_units_allocated", tenant=slug, flavor="h100-80gb") == units
        admitted = (_value(after, "portal_scheduler_admissions_total", tenant=slug)
                    - _value(before, "portal_scheduler_admissions_total", tenant=slug))
        assert admitted == 1
    cycles = _value(after, "portal_scheduler_cycle_seconds_count") - _value(before, "portal_scheduler_cycle_seconds_count")
    assert cycles == 1
    assert _value(after, "portal_scheduler_cycle_seconds_sum") > _value(before, "portal_scheduler_cycle_seconds_sum")
    inf = _value(after, "portal_scheduler_cycle_seconds_bucket", le="+Inf")
    assert inf == _value(after, "portal_scheduler_cycle_seconds_count")


@pytest.mark.django_db
def test_a_preemption_is_counted_for_the_victims_tenant(
    flavors, tenant, other_tenant, owner, outsider, acme_env, globex_env, staff, client_for
):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=0, max=16)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    borrower = submit(owner, acme_env, name="borrower", replicas=2, gpus_per_replica=8,
                       topology={"level": "none", "mode": "preferred"})
    scheduling.cycle_run()
    borrower.refresh_from_db()
    assert jobs.transition(borrower, JobState.LAUNCHING, "test") and jobs.transition(borrower, JobState.RUNNING, "test")
    client = client_for(staff)
    before = _scrape(client)
    assert _value(before, "portal_gpu_units_allocated", tenant="acme", flavor="h100-80gb") == 16

    submit(outsider, globex_env, name="owed", replicas=1, gpus_per_replica=8, priority=50)
    assert scheduling.cycle_run()["preempted"] == [borrower.id]

    after = _scrape(client)
    preempted = (_value(after, "portal_scheduler_preemptions_total", tenant="acme")
                 - _value(before, "portal_scheduler_preemptions_total", tenant="acme"))
    assert preempted == 1
    assert _value(after, "portal_gpu_units_allocated", tenant="acme", flavor="h100-80gb") == 16, (
        "a preempted job holds its GPUs until it has stopped"
    )
    assert _value(after, "portal_jobs_queued", tenant="globex", flavor="h100-80gb") == 1


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_a_task_that_raises_in_a_real_worker_is_counted_by_name(celery_worker, staff, client_for, settings):
    client = client_for(staff)
    before = _value(_scrape(client), "portal_celery_task_failures_total", task="runners.tasks.job_stop")
    # A message without its argument: the task raises TypeError in the worker, as a bad message would.
    app.send_task("runners.tasks.job_stop", args=[], queue=settings.CELERY_TASK_DEFAULT_QUEUE)
    wait_for(
        lambda: _value(_scrape(client), "portal_celery_task_failures_total", task="runners.tasks.job_stop") == before + 1,
        timeout_s=60, message=f"the worker's failure to be counted; worker log:\n{celery_worker.output()[-2000:]}",
    )
    # The worker logs the traceback after counting the failure: wait for it rather than race it.
    wait_for(lambda: "TypeError" in celery_worker.output(), timeout_s=30, message="the TypeError in the worker's log")


@pytest.mark.django_db
def test_with_redis_down_the_cycle_still_runs_and_the_scrape_still_answers(
    flavors, tenant, owner, acme_env, staff, client_for, settings, caplog
):
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=8)
    job = submit(owner, acme_env, replicas=1, gpus_per_replica=2)
    settings.CELERY_BROKER_URL = UNREACHABLE  # the store follows the broker's Redis; tasks are not sent here
    with caplog.at_level(logging.WARNING, logger="common.metrics"):
        assert scheduling.cycle_run()["admitted"] == [job.id]
    assert "Could not record a scheduler cycle in the metrics store" in caplog.text

    samples = _scrape(client_for(staff))
    assert _value(samples, "portal_metrics_store_up") == 0
    assert not any(name.startswith("portal_scheduler_") for name, _ in samples), "missing, not zero"
    assert _value(samples, "portal_gpu_units_allocated", tenant="acme", flavor="h100-80gb") == 2


@pytest.mark.django_db
def test_only_staff_and_the_scrape_token_read_it(owner, staff, client_for, settings):
    settings.METRICS_SCRAPE_TOKEN = SCRAPE_TOKEN
    anonymous = APIClient().get("/metrics")
    assert anonymous.status_code == 401
    assert anonymous["WWW-Authenticate"].startswith("Bearer")
    assert client_for(owner).get("/metrics").status_code == 403, "a tenant's token reads no one's figures"
    tenant_session = Client()
    tenant_session.force_login(owner)
    assert tenant_session.get("/metrics").status_code == 403
    staff_session = Client()
    staff_session.force_login(staff)
    assert staff_session.get("/metrics").status_code == 200

    scraper = APIClient()
    scraper.credentials(HTTP_AUTHORIZATION=f"Bearer {SCRAPE_TOKEN}")
    assert _value(_scrape(scraper), "portal_metrics_store_up") == 1
    for wrong in (f"Bearer {SCRAPE_TOKEN}x", "Bearer", f"Bearer {SCRAPE_TOKEN} extra"):
        bad = APIClient()
        bad.credentials(HTTP_AUTHORIZATION=wrong)
        assert bad.get("/metrics").status_code == 401, wrong

    settings.METRICS_SCRAPE_TOKEN = ""
    assert scraper.get("/metrics").status_code == 401, "no scrape token is set: none is accepted"


@pytest.mark.django_db
def test_an_app_above_adds_its_figures_through_metrics_collect_and_a_broken_one_costs_nothing(
    staff, client_for
):
    def idle(sender, **kwargs):
        family = GaugeMetricFamily("portal_gpu_units_idle", "Idle units by tenant.", labels=["tenant"])
        family.add_metric(["acme"], 3)
        return [family]

    def broken(sender, **kwargs):
        raise RuntimeError("this app's figures are broken")

    metrics_collect.connect(idle, dispatch_uid="test-idle")
    metrics_collect.connect(broken, dispatch_uid="test-broken")
    try:
        samples = _scrape(client_for(staff))
    finally:
        metrics_collect.disconnect(dispatch_uid="test-idle")
        metrics_collect.disconnect(dispatch_uid="test-broken")
    assert _value(samples, "portal_gpu_units_idle", tenant="acme") == 3
    assert _value(samples, "portal_metrics_store_up") == 1
