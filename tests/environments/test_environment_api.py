"""Self-service environments through the REST API."""

import pytest

from runners.environments.models import Environment

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


def test_a_member_requests_an_environment(client_for, teammate, tenant, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        response = client_for(teammate).post("/api/v1/environments/", {"tenant": "acme", "name": "train"})
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["state"] == "requested"
    assert body["namespace"] == "acme--train", "slug and name joined by the separator neither may hold"
    assert body["tenant"] == "acme"
    assert len(callbacks) == 1, "provisioning is enqueued once, after commit"


def test_a_viewer_creating_an_environment_gets_403(client_for, viewer, tenant):
    response = client_for(viewer).post("/api/v1/environments/", {"tenant": "acme", "name": "train"})
    assert response.status_code == 403
    assert not Environment.objects.exists()


def test_a_viewer_can_read_environments(client_for, viewer, owner, tenant):
    Environment.objects.create(tenant=tenant, name="train", namespace="acme-train", backend="local")
    response = client_for(viewer).get("/api/v1/environments/")
    assert response.status_code == 200
    assert [e["name"] for e in response.json()["results"]] == ["train"]


def test_a_viewer_deleting_an_environment_gets_403(client_for, viewer, tenant):
    environment = Environment.objects.create(tenant=tenant, name="train", namespace="acme-train", backend="local")
    assert client_for(viewer).delete(f"/api/v1/environments/{environment.id}/").status_code == 403
    environment.refresh_from_db()
    assert environment.state == "requested"


def test_delete_marks_it_deleting_and_enqueues_teardown(client_for, teammate, tenant, django_capture_on_commit_callbacks):
    environment = Environment.objects.create(
        tenant=tenant, name="train", namespace="acme-train", backend="local", state="ready"
    )
    with django_capture_on_commit_callbacks() as callbacks:
        response = client_for(teammate).delete(f"/api/v1/environments/{environment.id}/")
    assert response.status_code == 202
    assert response.json()["state"] == "deleting"
    assert len(callbacks) == 1
    with django_capture_on_commit_callbacks() as again:
        assert client_for(teammate).delete(f"/api/v1/environments/{environment.id}/").status_code == 202
    assert again == [], "a second delete does not enqueue a second teardown"


def test_a_deleted_name_can_be_used_again(client_for, teammate, tenant):
    Environment.objects.create(tenant=tenant, name="train", namespace="acme-train", backend="local", state="deleted")
    response = client_for(teammate).post("/api/v1/environments/", {"tenant": "acme", "name": "train"})
    assert response.status_code == 201
    assert client_for(teammate).get("/api/v1/environments/").json()["count"] == 1
    assert client_for(teammate).get("/api/v1/environments/?state=deleted").json()["count"] == 1


@pytest.mark.parametrize(
    ("payload", "field", "phrase"),
    [
        ({"tenant": "acme", "name": "Bad_Name"}, "name", "DNS-1123"),
        ({"tenant": "acme", "name": "-leading"}, "name", "DNS-1123"),
        ({"tenant": "acme", "name": "x" * 33}, "name", "no more than 32"),
        ({"tenant": "acme", "name": ""}, "name", "blank"),
        ({"tenant": "acme"}, "name", "required"),
        ({"tenant": "nope", "name": "train"}, "tenant", "no tenant"),
        ({"tenant": "x" * 31, "name": "train"}, "tenant", "no more than 30"),
        ({"name": "train"}, "tenant", "required"),
    ],
)
def test_bad_input_gets_400_naming_the_field(client_for, owner, tenant, payload, field, phrase):
    response = client_for(owner).post("/api/v1/environments/", payload)
    assert response.status_code == 400, response.content
    errors = response.json()
    assert field in errors
    assert phrase.lower() in " ".join(errors[field]).lower()
    assert not Environment.objects.exists()


def test_a_duplicate_name_in_one_tenant_gets_400(client_for, owner, tenant):
    assert client_for(owner).post("/api/v1/environments/", {"tenant": "acme", "name": "train"}).status_code == 201
    response = client_for(owner).post("/api/v1/environments/", {"tenant": "acme", "name": "train"})
    assert response.status_code == 400
    assert "already has an environment" in response.json()["name"][0]
    assert Environment.objects.count() == 1


def test_the_same_name_in_another_tenant_is_fine(client_for, owner, outsider, tenant, other_tenant):
    assert client_for(owner).post("/api/v1/environments/", {"tenant": "acme", "name": "train"}).status_code == 201
    assert client_for(outsider).post("/api/v1/environments/", {"tenant": "globex", "name": "train"}).status_code == 201


def test_an_unknown_state_filter_gets_400(client_for, owner, tenant):
    response = client_for(owner).get("/api/v1/environments/?state=bogus")
    assert response.status_code == 400
    assert "state" in response.json()


def test_lists_are_paginated(client_for, owner, tenant):
    for index in range(3):
        Environment.objects.create(tenant=tenant, name=f"e{index}", namespace=f"acme-e{index}", backend="local")
    body = client_for(owner).get("/api/v1/environments/?page=1").json()
    assert body["count"] == 3 and {"next", "previous", "results"} <= body.keys()


@pytest.mark.parametrize(
    ("url", "field"),
    [("/api/v1/environments/?tenant=%00", "tenant"), ("/api/v1/environments/?state=%00", "state"),
     ("/api/v1/quotas/?tenant=%00x", "tenant")],
)
def test_a_null_character_in_a_filter_is_a_400_naming_it(client_for, owner, tenant, url, field):
    response = client_for(owner).get(url)
    assert response.status_code == 400
    assert field in response.json()


def test_a_null_character_in_a_looked_up_field_is_a_400(client_for, staff, tenant):
    response = client_for(staff).post(
        "/api/v1/quotas/", {"tenant": "acme\x00", "flavor": "x", "guaranteed": 1, "max": 1}, format="json"
    )
    assert response.status_code == 400
    assert response.json()["tenant"] == ["Null characters are not allowed."]


def test_a_name_that_would_make_a_cluster_namespace_is_refused(client_for, staff, make_user):
    from tenants.models import Membership, Tenant

    kube = Tenant.objects.create(slug="kube", name="Kube team")
    owner = make_user("gina")
    Membership.objects.create(user=owner, tenant=kube, role="owner")
    response = client_for(owner).post("/api/v1/environments/", {"tenant": "kube", "name": "system"})
    assert response.status_code == 400
    assert "reserved for the cluster" in response.json()["name"][0]
    assert not Environment.objects.exists()
