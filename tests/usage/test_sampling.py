"""Utilization end to end on the local backend: real workloads read, stored, downsampled, and judged idle or busy.

A training job computes; an inference endpoint's replica gets no request and idles. Both run as
real processes on the demo cluster's simulated GPUs, whose readings are the workloads' own measured
activity (marked simulated). The sampler's pass is the one the beat runs.
"""

import time
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from runners.inference.models import EndpointState, InferenceEndpoint
from runners.jobs import attempts
from runners.jobs import services as jobs
from runners.jobs.models import JobAttempt
from runners.usage import sampling
from runners.usage.models import Resolution, UtilizationSample
from tests.support.endpoints import drive, trained_job
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment, reconcile_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def world(settings, tenant, other_tenant, owner, outsider):
    settings.PREEMPTION_GRACE_PERIOD_S = 20
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=4)
    environment = ready_environment(actor=owner, tenant=tenant)
    return {"environment": environment, "other": ready_environment(actor=outsider, tenant=other_tenant, name="vision")}


def _sample_until(condition, *, timeout_s=90):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sampling.sample_run()
        if condition():
            return
        time.sleep(1)
    raise AssertionError("the samples never showed what was waited for")


def test_an_idle_replica_is_flagged_and_a_computing_job_never_is(world, owner, outsider, staff, client_for, settings):
    from runners.scheduling import services as scheduling

    environment = world["environment"]
    busy = jobs.job_submit(actor=owner, data=job_data(environment, name="busy", replicas=1, topology={"level": "none"},
                                                      steps=100000, checkpoint_every_steps=100000, max_runtime_s=600))
    scheduling.cycle_run()
    attempts.job_launch_run(job_id=busy.id, attempt_number=1)
    busy = reconcile_until(busy, {"running"})
    source = trained_job(actor=owner, environment=environment)
    created = client_for(owner).post("/api/v1/endpoints/", {
        "tenant": "acme", "environment": environment.id, "name": "quiet", "source": {"job": source.id},
        "flavor": "h100-80gb", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 1, "warm_replicas": 0,
        "queue_limit": 8, "batch_token_budget": 4096, "max_batch_wait_ms": 5, "default_deadline_ms": 5000,
    }, format="json")
    assert created.status_code == 201, created.json()
    endpoint = drive(InferenceEndpoint.objects.get(id=created.json()["id"]), lambda e: e.state == EndpointState.READY)
    replica_job = endpoint.replicas.get().job
    started = timezone.now()

    def read_both_twice():
        counts = {job.id: UtilizationSample.objects.filter(job=job, at__gte=started).count() for job in (busy, replica_job)}
        return all(count >= 2 for count in counts.values())

    _sample_until(read_both_twice)
    samples = UtilizationSample.objects.filter(at__gte=started)
    assert {sample.source for sample in samples} == {"simulated"}
    assert max(s.gpu_util_pct for s in samples.filter(job=busy)) > 50
    assert max(s.gpu_util_pct for s in samples.filter(job=replica_job)) < 10

    # Judged over a window the two attempts have held their GPUs for (they started before it began).
    window_s = (timezone.now() - started).total_seconds() + 0.5
    JobAttempt.objects.filter(job__in=[busy, replica_job]).update(started_at=started - timedelta(seconds=5))
    idle = sampling.idle_allocations(window_s=window_s, threshold_pct=10)
    assert [(item.job.id, item.endpoint_id, item.simulated) for item in idle] == [(replica_job.id, endpoint.id, True)]
    # A window longer than the attempts have run judges nothing: too little is known.
    assert sampling.idle_allocations(window_s=3600, threshold_pct=10) == []

    api = client_for(owner)
    listed = api.get(f"/api/v1/usage/idle/?window_s={window_s}&threshold_pct=10").json()
    assert [(row["job"], row["endpoint"]) for row in listed] == [(replica_job.id, endpoint.id)]
    series = api.get(f"/api/v1/utilization/?job={busy.id}").json()["series"]
    assert series and series[0]["simulated"] and series[0]["points"][0]["gpu_util_pct"] is not None
    assert api.get(f"/api/v1/utilization/?endpoint={endpoint.id}").json()["series"][0]["job"] == replica_job.id

    # Another tenant sees none of it: 404 for the job and endpoint, nothing idle, no usage rows.
    other = client_for(outsider)
    assert other.get(f"/api/v1/utilization/?job={busy.id}").status_code == 404
    assert other.get(f"/api/v1/utilization/?endpoint={endpoint.id}").status_code == 404
    assert other.get(f"/api/v1/usage/idle/?window_s={window_s}&threshold_pct=10").json() == []
    assert other.get("/api/v1/usage/?group_by=job").json() == []
    assert other.get("/api/v1/usage/?tenant=acme").status_code == 404
    assert other.get("/api/v1/usage/idle/?tenant=acme").status_code == 404
    assert other.get("/metrics").status_code == 403
    # Staff read the idle allocation on /metrics (the usage app answers the portal's collect signal).
    from prometheus_client.parser import text_string_to_metric_families

    settings.USAGE_IDLE_WINDOW_S, settings.USAGE_IDLE_THRESHOLD_PCT = window_s, 10
    scraped = client_for(staff).get("/metrics")
    families = {family.name: family for family in text_string_to_metric_families(scraped.content.decode())}
    assert [(s.labels, s.value) for s in families["portal_gpu_units_idle"].samples] == [
        ({"tenant": "acme", "flavor": "h100-80gb"}, 1.0)
    ]

    jobs.job_cancel(actor=owner, job=busy)
    api.post(f"/api/v1/endpoints/{endpoint.id}/stop/")
    drive(endpoint, lambda e: e.state == EndpointState.STOPPED)


@pytest.mark.django_db
def test_raw_samples_are_averaged_into_5_minute_then_hourly_buckets_and_dropped_after_retention(tenant, owner, settings):
    settings.USAGE_RAW_RETENTION_DAYS, settings.USAGE_5M_RETENTION_DAYS, settings.USAGE_RETENTION_DAYS = 1, 30, 400
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=1, max=1)
    environment = ready_environment(actor=owner, tenant=tenant)
    job = jobs.job_submit(actor=owner, data=job_data(environment, name="old", replicas=1, topology={"level": "none"}))
    now = datetime(2026, 11, 20, 12, tzinfo=UTC)

    def sample(moment, util, resolution=Resolution.RAW):
        UtilizationSample.objects.create(tenant=tenant, job=job, attempt=1, rank=0, device="sim-1/gpu0", at=moment,
                                         resolution=resolution, source="simulated", gpu_util_pct=util,
                                         memory_used_mib=1000 + util)

    two_days_ago = now - timedelta(days=2)
    for second, util in ((0, 10), (30, 20), (60, 30), (330, 90)):  # three in one 5-minute bucket, one in the next
        sample(two_days_ago + timedelta(seconds=second), util)
    sample(now - timedelta(minutes=1), 50)  # recent: stays raw
    sample(now - timedelta(days=40), 40, Resolution.FIVE_MINUTES)
    sample(now - timedelta(days=40) + timedelta(minutes=5), 60, Resolution.FIVE_MINUTES)
    sample(now - timedelta(days=500), 70, Resolution.HOUR)

    sampling.downsample_run(now=now)
    rows = list(UtilizationSample.objects.order_by("at").values_list("resolution", "gpu_util_pct", "readings"))
    assert rows == [
        ("1h", 50.0, 2),  # two 5-minute buckets of one reading each, older than 30 days: one hour
        ("5m", 20.0, 3), ("5m", 90.0, 1),  # older than a day: 5-minute averages
        ("raw", 50.0, 1),
    ]
    # Run again: nothing changes (buckets are whole; nothing is averaged twice).
    sampling.downsample_run(now=now)
    assert list(UtilizationSample.objects.order_by("at").values_list("resolution", "gpu_util_pct", "readings")) == rows
