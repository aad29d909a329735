"""Edges of the submit: a gang that no NVLink domain can hold is refused at once, and the 429 past the
tenant's queued-job budget says when to try again."""

import pytest

from runners.jobs.models import Job
from tests.support.jobs import give_quota, job_data

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


def _post(client, data):
    return client.post("/api/v1/jobs/", data, format="json")


def test_a_gang_that_no_nvlink_domain_can_hold_is_refused_naming_replicas(client_for, owner, acme_env, tenant, flavors):
    """Before the fix 2 x 8 GPUs with nvlink required was accepted (the demo's NVLink domains hold 8 each) and
    waited in the queue for ever; node-level was already refused."""
    give_quota(tenant, flavors["h100-80gb"], guaranteed=16, max=16)
    client = client_for(owner)
    nvlink = {"level": "nvlink", "mode": "required"}
    response = _post(client, job_data(acme_env, replicas=2, gpus_per_replica=8, topology=nvlink))
    assert response.status_code == 400, response.json()
    assert "one NVLink domain" in response.json()["replicas"][0] and "at most 1" in response.json()["replicas"][0]
    assert not Job.objects.exists()
    # What one domain holds is taken, and a preference is no promise: both are accepted.
    assert _post(client, job_data(acme_env, name="a", replicas=2, gpus_per_replica=4, topology=nvlink)).status_code == 201
    preferred = {"level": "nvlink", "mode": "preferred"}
    assert _post(client, job_data(acme_env, name="b", replicas=2, gpus_per_replica=8,
                                  topology=preferred)).status_code == 201


def test_the_429_past_the_queued_job_budget_says_when_to_retry_and_the_schema_documents_it(
    client_for, owner, acme_env, tenant, flavors, settings
):
    """Before the fix the 429 had no Retry-After, and the schema did not list a 429 for the submit."""
    settings.JOB_QUEUED_MAX_PER_TENANT = 1
    settings.SCHEDULER_CYCLE_INTERVAL_S = 2.5
    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=16)
    client = client_for(owner)
    assert _post(client, job_data(acme_env, name="a")).status_code == 201
    response = _post(client, job_data(acme_env, name="b"))
    assert response.status_code == 429
    assert "JOB_QUEUED_MAX_PER_TENANT" in response.json()["detail"]
    assert response["Retry-After"] == "3"  # the next cycle, in whole seconds
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    refused = schema["paths"]["/api/v1/jobs/"]["post"]["responses"]["429"]
    assert "JOB_QUEUED_MAX_PER_TENANT" in refused["description"]
    assert refused["headers"]["Retry-After"]["schema"]["type"] == "integer"
