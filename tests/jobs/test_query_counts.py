"""The hot read endpoints cost a fixed number of queries, whatever the number of rows on the page.

Each list is read with 25 rows (more than enough for an N+1 to show), each with what it nests:
a job's attempts, checkpoints and events, submitted by different users. The counts include the
token's three (knox's lookup, its sweep of the user's expired tokens, and "last used").
bench/api_load.py measures the same endpoints under load.

Also here: the jobs API's short way of building its answers (runners.jobs.serializers) gives
exactly DRF's own answer, for every field and for a job read with and without the view's prefetch.
"""

from datetime import timedelta

import pytest
from django.utils import timezone

from quotas.models import ResourceFlavor
from runners.environments.models import Environment
from runners.jobs.models import Checkpoint, Job, JobAttempt, JobEvent
from tenants.models import Membership, Tenant
from tests.support.jobs import give_quota, job_data

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

ROWS = 25
TOKEN_QUERIES = 3


@pytest.fixture
def jobs(acme_env, flavors, tenant, owner, make_user):
    """ROWS jobs of acme in every state, each with attempts, checkpoints and events, by several users."""
    give_quota(tenant, flavors["h100-80gb"], guaranteed=4, max=8)
    submitters = [owner, *(make_user(f"bot-{n}") for n in range(3)), None]
    now = timezone.now()
    states = ["succeeded", "failed", "cancelled", "running", "queued", "preempted"]
    made = []
    for n in range(ROWS):
        spec = job_data(acme_env, name=f"job-{n}")
        job = Job.objects.create(
            tenant=tenant, environment=acme_env, name=spec["name"], spec=spec, flavor=flavors["h100-80gb"],
            replicas=2, gpus_per_replica=1, state=states[n % len(states)], reason=f"Because {n}.",
            submitted_by=submitters[n % len(submitters)], queue_position=n if n % 6 == 4 else None,
            projected_start=now + timedelta(minutes=n) if n % 6 == 4 else None,
            stop_deadline=now if n % 6 == 5 else None, started_at=now if n % 6 != 4 else None,
            finished_at=now if n % 6 < 3 else None,
        )
        for number in (1, 2):
            placement = [{"replica": r, "node": f"node-{r}", "gpus": [r]} for r in range(2)]
            if n % 2:
                placement[0].update(mig_profile="1g.10gb", mig_start=0)
            JobAttempt.objects.create(job=job, number=number, placement=placement, started_at=now,
                                      ended_at=now if number == 1 else None, outcome="preempted" if number == 1 else "",
                                      exit_code=None if number == 2 else 143, resumed_from_step=10 * (number - 1) or None)
        for step in (10, 20):
            Checkpoint.objects.create(job=job, step=step, uri=f"file:///ckpt/{job.id}/{step}", bytes=step,
                                      created_at=now)
        for to_state in ("queued", "admitted", "running"):
            JobEvent.objects.create(job=job, from_state="" if to_state == "queued" else "queued", to_state=to_state,
                                    reason=to_state)
        made.append(job)
    return made


def _get(client, path):
    response = client.get(path)
    assert response.status_code == 200, response.content[:300]
    return response.json()


def test_the_job_list_and_a_job_cost_a_fixed_number_of_queries(client_for, owner, jobs, django_assert_max_num_queries):
    client = client_for(owner)
    # The caller's tenants, count, page, then one query for each nested list: attempts, checkpoints, events.
    with django_assert_max_num_queries(TOKEN_QUERIES + 6):
        body = _get(client, "/api/v1/jobs/")
    assert body["count"] == ROWS and len(body["results"]) == ROWS
    assert all(len(job["attempts"]) == 2 and len(job["events"]) == 3 for job in body["results"])
    with django_assert_max_num_queries(TOKEN_QUERIES + 6):
        body = _get(client, "/api/v1/jobs/?tenant=acme&state=running")
    assert {job["state"] for job in body["results"]} == {"running"}
    with django_assert_max_num_queries(TOKEN_QUERIES + 4):
        _get(client, f"/api/v1/jobs/{jobs[0].id}/")


def test_the_environment_list_and_an_environment_cost_a_fixed_number_of_queries(
    client_for, owner, tenant, acme_env, make_user, django_assert_max_num_queries
):
    creators = [owner, make_user("eve"), None]
    for n in range(ROWS):
        Environment.objects.create(tenant=tenant, name=f"env-{n:02d}", namespace=f"acme--env-{n:02d}",
                                   backend="local", state="ready", created_by=creators[n % len(creators)])
    client = client_for(owner)
    with django_assert_max_num_queries(TOKEN_QUERIES + 2):
        body = _get(client, "/api/v1/environments/")
    assert body["count"] == ROWS + 1
    with django_assert_max_num_queries(TOKEN_QUERIES + 1):
        _get(client, f"/api/v1/environments/{acme_env.id}/")


def test_the_quota_and_flavor_lists_cost_a_fixed_number_of_queries(
    client_for, owner, tenant, flavor_factory, django_assert_max_num_queries
):
    models = ["A100-40GB", "A100-80GB", "H100-80GB", "H100-94GB", "H200-141GB", "L4", "L40S", "T4", "A10"]
    shapes = [*(("whole", model, "") for model in models), *(("timeslice", model, "") for model in models),
              *(("mig", model, "1g.10gb") for model in models[:3])]  # 21 flavors
    made = [flavor_factory(name=f"gpu-{n:02d}", kind=kind, gpu_model=model, mig_profile=profile)
            for n, (kind, model, profile) in enumerate(shapes)]
    for n, flavor in enumerate(made):
        give_quota(tenant, flavor, guaranteed=n, max=n + 1)
        flavor.prices.create(price_per_hour=n + 1, currency="USD", effective_from=timezone.now() - timedelta(days=1))
        flavor.prices.create(price_per_hour=99, currency="USD", effective_from=timezone.now() + timedelta(days=1))
    client = client_for(owner)
    with django_assert_max_num_queries(TOKEN_QUERIES + 2):
        body = _get(client, "/api/v1/quotas/")
    assert body["count"] == len(made)
    with django_assert_max_num_queries(TOKEN_QUERIES + 3):
        body = _get(client, "/api/v1/flavors/?page_size=100")
    prices = {flavor["name"]: flavor["price"] for flavor in body["results"]}
    # The price in force now, not the one that starts tomorrow.
    assert prices["gpu-03"]["price_per_hour"] == "4.0000"
    assert ResourceFlavor.objects.count() == len(body["results"]) == len(made)


def test_the_tenant_list_costs_a_fixed_number_of_queries(client_for, make_user, django_assert_max_num_queries):
    user = make_user("many")
    for n in range(ROWS):
        Membership.objects.create(user=user, tenant=Tenant.objects.create(slug=f"team-{n}", name=f"Team {n}"),
                                  role=["owner", "member", "viewer"][n % 3])
    client = client_for(user)
    with django_assert_max_num_queries(TOKEN_QUERIES + 2):
        body = _get(client, "/api/v1/tenants/")
    assert body["count"] == ROWS
    assert {tenant["my_role"] for tenant in body["results"]} == {"owner", "member", "viewer"}


def test_the_short_way_gives_drf_s_own_answer(jobs, monkeypatch):
    """JobSerializer's output, field for field, against DRF's Serializer.to_representation."""
    from rest_framework import serializers

    from runners.jobs import api
    from runners.jobs.serializers import PlainFieldsMixin, attach_nested_rows

    Job.objects.filter(id=jobs[0].id).update(submitted_by=None, reason="", projected_start=timezone.now())
    prefetched = list(api.JobViewSet.queryset.defer(*api.JobViewSet.READS_DEFER).order_by("id"))
    attach_nested_rows(prefetched, api.JobViewSet.NESTED)
    plain = Job.objects.order_by("id")
    short = [api.JobSerializer(prefetched, many=True).data, api.JobSerializer(plain, many=True).data]
    monkeypatch.setattr(PlainFieldsMixin, "to_representation", serializers.Serializer.to_representation)
    reference = api.JobSerializer(plain, many=True).data
    assert short[0] == reference and short[1] == reference
    assert reference[0]["submitted_by"] is None and reference[0]["projected_start"].endswith("Z")


def test_the_job_list_s_tenant_constants_keep_the_scoping(client_for, owner, outsider, staff, jobs, globex_env):
    """The list narrows to the caller's tenant ids as constants (for the index); who sees what is unchanged."""
    assert _get(client_for(outsider), "/api/v1/jobs/?tenant=acme")["count"] == 0
    assert _get(client_for(outsider), "/api/v1/jobs/")["count"] == 0
    assert _get(client_for(owner), "/api/v1/jobs/?tenant=no-such")["count"] == 0
    assert _get(client_for(owner), "/api/v1/jobs/?tenant=acme&page=1")["count"] == ROWS
    assert _get(client_for(staff), "/api/v1/jobs/")["count"] == ROWS
    assert _get(client_for(staff), "/api/v1/jobs/?tenant=acme")["count"] == ROWS
    newest_first = [job["id"] for job in _get(client_for(owner), "/api/v1/jobs/?page_size=100")["results"]]
    assert newest_first == sorted(newest_first, reverse=True)
