"""The endpoint API's checks: exactly the documented shape, each bad field named, tenants apart."""

import pytest

from runners.inference.models import InferenceEndpoint
from tests.support.endpoints import trained_job
from tests.support.jobs import demo_cluster_with_flavors, give_quota, job_data, ready_environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def world(settings, tenant, other_tenant, owner, outsider):
    settings.PREEMPTION_GRACE_PERIOD_S = 30
    flavors = demo_cluster_with_flavors()
    give_quota(tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    give_quota(other_tenant, flavors["h100-80gb"], guaranteed=2, max=4)
    environment = ready_environment(actor=owner, tenant=tenant)
    other = ready_environment(actor=outsider, tenant=other_tenant)
    return {
        "environment": environment, "job": trained_job(actor=owner, environment=environment),
        "other_job": trained_job(actor=outsider, environment=other, name="theirs"),
    }


def data(world, **overrides) -> dict:
    body = {"tenant": "acme", "environment": world["environment"].id, "name": "chat", "source": {"job": world["job"].id},
            "flavor": "h100-80gb", "gpus_per_replica": 1, "min_replicas": 1, "max_replicas": 2, "warm_replicas": 0,
            "queue_limit": 64, "batch_token_budget": 4096, "max_batch_wait_ms": 5, "default_deadline_ms": 10000}
    body.update(overrides)
    return body


def post(client, body):
    answer = client.post("/api/v1/endpoints/", body, format="json")
    return answer.status_code, answer.json()


@pytest.mark.parametrize("field, value", [
    ("privileged", True), ("replicas", 2), ("nodeSelector", {"a": "b"}), ("image", "evil/image"), ("command", ["sh"]),
])
def test_any_field_outside_the_documented_shape_is_a_400_naming_it(world, client_for, owner, field, value):
    status, body = post(client_for(owner), data(world, **{field: value}))
    assert status == 400 and field in body, body
    assert not InferenceEndpoint.objects.exists()


@pytest.mark.parametrize("overrides, field", [
    ({"source": {"job": 1, "path": "/etc/passwd"}}, "source.path"),
    ({"source": {}}, "source"),
    ({"source": {"image": "nvcr.io/nvidia/serve:1"}}, "source.image"),  # custom images: Kubernetes only
    ({"name": "Not A Label"}, "name"),
    ({"flavor": "no-such"}, "flavor"),
    ({"min_replicas": 3, "max_replicas": 4}, "min_replicas"),  # 3 units are past the guarantee of 2
    ({"max_replicas": 5}, "max_replicas"),  # past the max of 4
    ({"max_replicas": 1, "min_replicas": 2}, "max_replicas"),
    ({"warm_replicas": 3}, "warm_replicas"),
    ({"default_deadline_ms": 60_000}, "default_deadline_ms"),  # a drain of 30 s could not answer it
    ({"queue_limit": 0}, "queue_limit"),
    ({"batch_token_budget": "lots"}, "batch_token_budget"),
    ({"gpus_per_replica": True}, "gpus_per_replica"),
])
def test_bad_values_are_a_400_naming_the_field(world, client_for, owner, overrides, field):
    status, body = post(client_for(owner), data(world, **overrides))
    assert status == 400 and field in body, body


def test_the_source_must_be_a_checkpoint_of_the_tenants_own_training_job(world, client_for, owner):
    client = client_for(owner)
    status, body = post(client, data(world, source={"job": world["other_job"].id}))
    assert status == 400 and "source.job" in body
    from runners.jobs import services as jobs

    fresh = jobs.job_submit(actor=owner, data=job_data(world["environment"], name="fresh", replicas=1,
                                                          topology={"level": "none"}))
    status, body = post(client, data(world, source={"job": fresh.id}))
    assert status == 400 and "no checkpoint" in body["source.job"][0]
    status, body = post(client, data(world, source={"job": world["job"].id, "step": 999}))
    assert status == 400 and "source.step" in body
    status, body = post(client, data(world))
    assert status == 201 and body["source"] == {"job": world["job"].id, "step": 10}
    status, body = post(client, data(world))
    assert status == 400 and "name" in body  # one live endpoint of a name per tenant


def test_viewers_read_members_deploy_and_other_tenants_get_404(world, client_for, owner, viewer, outsider):
    status, body = post(client_for(viewer), data(world))
    assert status == 403
    status, body = post(client_for(owner), data(world))
    assert status == 201
    endpoint_id = body["id"]
    assert client_for(viewer).get(f"/api/v1/endpoints/{endpoint_id}/").status_code == 200
    them = client_for(outsider)
    assert them.get(f"/api/v1/endpoints/{endpoint_id}/").status_code == 404
    assert them.get("/api/v1/endpoints/").json()["count"] == 0
    for action in ("scale", "rollout", "stop"):
        assert them.post(f"/api/v1/endpoints/{endpoint_id}/{action}/", {}, format="json").status_code == 404
    status, body = post(them, data(world, tenant="acme"))
    assert status == 400 and "tenant" in body


def test_scale_and_rollout_take_only_their_fields(world, client_for, owner):
    client = client_for(owner)
    endpoint_id = post(client, data(world))[1]["id"]
    answer = client.post(f"/api/v1/endpoints/{endpoint_id}/scale/", {"replicas": 3}, format="json")
    assert answer.status_code == 400 and "replicas" in answer.json()
    answer = client.post(f"/api/v1/endpoints/{endpoint_id}/scale/", {"max_replicas": 9}, format="json")
    assert answer.status_code == 400 and "max_replicas" in answer.json()
    answer = client.post(f"/api/v1/endpoints/{endpoint_id}/scale/", {"max_replicas": 3, "warm_replicas": 1},
                         format="json")
    assert answer.status_code == 202 and answer.json()["max_replicas"] == 3
    answer = client.post(f"/api/v1/endpoints/{endpoint_id}/rollout/", {"source": {"job": world["other_job"].id}},
                         format="json")
    assert answer.status_code == 400 and "source.job" in answer.json()
    answer = client.post(f"/api/v1/endpoints/{endpoint_id}/rollout/", {"source": {"job": world["job"].id}},
                         format="json")
    assert answer.status_code == 202 and answer.json()["generation"] == 2
    assert client.post(f"/api/v1/endpoints/{endpoint_id}/stop/").status_code == 202
    answer = client.post(f"/api/v1/endpoints/{endpoint_id}/scale/", {"max_replicas": 2}, format="json")
    assert answer.status_code == 409


def test_the_schema_documents_the_endpoints_api(client_for, owner):
    schema = client_for(owner).get("/api/schema/", HTTP_ACCEPT="application/json").json()
    for path in ("/api/v1/endpoints/", "/api/v1/endpoints/{id}/scale/", "/api/v1/endpoints/{id}/rollout/",
                 "/api/v1/endpoints/{id}/stop/", "/serve/{tenant}/{name}/v1/generate"):
        assert path in schema["paths"], sorted(schema["paths"])
