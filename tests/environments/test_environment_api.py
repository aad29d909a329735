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
        ({"tenant": "acme", "name": "train", "workspace_image": "docker.io/evil/lab:1"}, "workspace_image",
         "images come from"),
        ({"tenant": "acme", "name": "train", "workspace_image": "nvcr.io/nvidia/Lab Image"}, "workspace_image",
         "not an image reference"),
        ({"tenant": "acme", "name": "train", "workspace_image": 7}, "workspace_image", "string"),
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


LAB_IMAGE = "nvcr.io/nvidia/pytorch:24.10-py3-lab"


def test_an_admin_sets_the_image_an_environments_workspaces_run_and_a_workspace_start_takes_it(
        client_for, owner, teammate, outsider, tenant):
    from audit.models import AuditEntry
    from runners.jobs.models import Job
    from runners.jobs.signals import workspace_launch
    from tests.support.jobs import demo_cluster_with_flavors, give_quota, ready_environment

    # What every member's workspaces run is the admins' choice, at creation as in a change.
    by_member = client_for(teammate).post("/api/v1/environments/", {"tenant": "acme", "name": "train",
                                                                     "workspace_image": LAB_IMAGE}, format="json")
    assert by_member.status_code == 403 and not Environment.objects.exists()
    created = client_for(owner).post("/api/v1/environments/", {"tenant": "acme", "name": "train",
                                                                "workspace_image": LAB_IMAGE}, format="json")
    assert created.status_code == 201 and created.json()["workspace_image"] == LAB_IMAGE
    assert AuditEntry.objects.get(action="environment.created").after["workspace_image"] == LAB_IMAGE
    environment = ready_environment(actor=owner, tenant=tenant, name="notebooks")
    url = f"/api/v1/environments/{environment.id}/"
    assert client_for(owner).get(url).json()["workspace_image"] == ""

    # Only the tenant's admins change it; another tenant's member is told nothing exists.
    assert client_for(teammate).patch(url, {"workspace_image": LAB_IMAGE}, format="json").status_code == 403
    assert client_for(outsider).patch(url, {"workspace_image": LAB_IMAGE}, format="json").status_code == 404
    refused = client_for(owner).patch(url, {"workspace_image": "ghcr.io/someone/lab:1"}, format="json")
    assert refused.status_code == 400 and "workspace_image" in refused.json()
    unknown = client_for(owner).patch(url, {"name": "renamed"}, format="json")
    assert unknown.status_code == 400 and "name" in unknown.json()
    environment.refresh_from_db()
    assert environment.workspace_image == "" and environment.name == "notebooks"

    changed = client_for(owner).patch(url, {"workspace_image": LAB_IMAGE}, format="json")
    assert changed.status_code == 200 and changed.json()["workspace_image"] == LAB_IMAGE
    entry = AuditEntry.objects.get(action="environment.workspace_image_changed")
    assert entry.before == {"workspace_image": ""} and entry.after == {"workspace_image": LAB_IMAGE}

    # A workspace's start in it runs that image (the backend's launch reads it from the workspace's answer).
    give_quota(tenant, demo_cluster_with_flavors()["t4-shared"], guaranteed=1, max=2)
    started = client_for(owner).post("/api/v1/workspaces/", {"tenant": "acme", "environment": environment.id,
                                                             "name": "nb", "flavor": "t4-shared"}, format="json")
    assert started.status_code == 201, started.content
    job = Job.objects.get(id=started.json()["job"])
    answers = [fields for _receiver, fields in workspace_launch.send(sender=Job, job=job) if fields]
    assert answers[0]["image"] == LAB_IMAGE
    # "" puts back the portal's own image.
    assert client_for(owner).patch(url, {"workspace_image": ""}, format="json").json()["workspace_image"] == ""
    answers = [fields for _receiver, fields in workspace_launch.send(sender=Job, job=job) if fields]
    assert answers[0]["image"] is None
