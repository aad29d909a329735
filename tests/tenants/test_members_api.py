"""Tenants and their members through the REST API."""

import pytest

from tenants.models import Membership, Tenant

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


def test_staff_create_tenants(client_for, staff):
    response = client_for(staff).post("/api/v1/tenants/", {"slug": "initech", "name": "Initech"})
    assert response.status_code == 201
    assert Tenant.objects.filter(slug="initech").exists()


def test_a_tenant_owner_cannot_create_tenants(client_for, owner):
    response = client_for(owner).post("/api/v1/tenants/", {"slug": "initech", "name": "Initech"})
    assert response.status_code == 403
    assert not Tenant.objects.filter(slug="initech").exists()


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"slug": "Not A Slug", "name": "X"}, "slug"),
        ({"slug": "acme", "name": "Duplicate"}, "slug"),
        ({"slug": "ok", "name": "n" * 101}, "name"),
        ({"slug": "ok"}, "name"),
    ],
)
def test_bad_tenant_input_gets_400_naming_the_field(client_for, staff, tenant, payload, field):
    before = Tenant.objects.count()
    response = client_for(staff).post("/api/v1/tenants/", payload)
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert Tenant.objects.count() == before


def test_a_tenant_shows_my_role(client_for, teammate, tenant):
    assert client_for(teammate).get("/api/v1/tenants/acme/").json()["my_role"] == "member"


def test_an_owner_adds_and_removes_a_member(client_for, owner, tenant, make_user):
    make_user("nina")
    client = client_for(owner)
    response = client.post("/api/v1/tenants/acme/members/", {"username": "nina", "role": "viewer"})
    assert response.status_code == 201
    assert [m["username"] for m in client.get("/api/v1/tenants/acme/members/").json()["results"]] == ["nina", "olivia"]
    assert client.delete("/api/v1/tenants/acme/members/nina/").status_code == 204
    assert not Membership.objects.filter(user__username="nina").exists()


def test_a_member_cannot_manage_members(client_for, teammate, tenant, make_user):
    make_user("nina")
    response = client_for(teammate).post("/api/v1/tenants/acme/members/", {"username": "nina", "role": "viewer"})
    assert response.status_code == 403
    assert not Membership.objects.filter(user__username="nina").exists()


def test_an_admin_cannot_grant_owner(client_for, make_user, tenant):
    admin = make_user("adam")
    Membership.objects.create(user=admin, tenant=tenant, role="admin")
    make_user("nina")
    response = client_for(admin).post("/api/v1/tenants/acme/members/", {"username": "nina", "role": "owner"})
    assert response.status_code == 403


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"username": "nina", "role": "emperor"}, "role"),
        ({"username": "ghost", "role": "member"}, "username"),
        ({"username": "olivia", "role": "member"}, "username"),
        ({"username": "u" * 151, "role": "member"}, "username"),
        ({"role": "member"}, "username"),
    ],
)
def test_bad_member_input_gets_400_naming_the_field(client_for, owner, tenant, make_user, payload, field):
    make_user("nina")
    before = Membership.objects.count()
    response = client_for(owner).post("/api/v1/tenants/acme/members/", payload)
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert Membership.objects.count() == before


def test_the_last_owner_cannot_be_removed(client_for, owner, tenant):
    response = client_for(owner).delete("/api/v1/tenants/acme/members/olivia/")
    assert response.status_code == 400
    assert "last owner" in response.json()["username"][0]
    assert Membership.objects.filter(user=owner).exists()


def test_removing_someone_who_is_not_a_member_is_404(client_for, owner, tenant):
    assert client_for(owner).delete("/api/v1/tenants/acme/members/ghost/").status_code == 404


def test_the_tenant_list_costs_the_same_queries_for_many_tenants(client_for, owner, django_assert_max_num_queries):
    for index in range(6):
        tenant = Tenant.objects.create(slug=f"t{index}", name=f"T{index}")
        Membership.objects.create(user=owner, tenant=tenant, role="viewer")
    client = client_for(owner)
    with django_assert_max_num_queries(5):
        body = client.get("/api/v1/tenants/").json()
    assert {t["my_role"] for t in body["results"]} == {"owner", "viewer"}
