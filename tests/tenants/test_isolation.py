"""Tenant isolation: an outsider gets 404 on every object of another tenant."""

import pytest

from runners.environments.models import Environment
from tenants.models import Membership

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def environment(tenant, owner):
    return Environment.objects.create(
        tenant=tenant, name="train", namespace="acme-train", backend="local", created_by=owner
    )


@pytest.fixture
def outsiders_environment(other_tenant, outsider):
    return Environment.objects.create(
        tenant=other_tenant, name="serve", namespace="globex-serve", backend="local", created_by=outsider
    )


OTHER_TENANT_URLS = [
    ("get", "/api/v1/tenants/acme/"),
    ("get", "/api/v1/tenants/acme/members/"),
    ("post", "/api/v1/tenants/acme/members/"),
    ("delete", "/api/v1/tenants/acme/members/olivia/"),
    ("get", "/api/v1/environments/{environment}/"),
    ("delete", "/api/v1/environments/{environment}/"),
]


@pytest.mark.parametrize(("method", "url"), OTHER_TENANT_URLS)
def test_the_outsider_gets_404_on_the_other_tenants_objects(client_for, outsider, environment, method, url):
    client = client_for(outsider)
    response = getattr(client, method)(url.format(environment=environment.id), {"username": "oscar", "role": "member"})
    assert response.status_code == 404, response.content
    environment.refresh_from_db()
    assert environment.state == "requested"
    assert Membership.objects.filter(tenant=environment.tenant, user=outsider).count() == 0


def test_lists_hold_only_the_callers_own_objects(client_for, owner, outsider, environment, outsiders_environment):
    tenants = client_for(outsider).get("/api/v1/tenants/").json()["results"]
    assert [t["slug"] for t in tenants] == ["globex"]
    environments = client_for(outsider).get("/api/v1/environments/").json()["results"]
    assert [e["id"] for e in environments] == [outsiders_environment.id]
    environments = client_for(owner).get("/api/v1/environments/").json()["results"]
    assert [e["id"] for e in environments] == [environment.id]


def test_filtering_by_another_tenant_shows_nothing(client_for, outsider, environment):
    response = client_for(outsider).get("/api/v1/environments/?tenant=acme")
    assert response.status_code == 200
    assert response.json()["results"] == []


def test_the_outsider_cannot_create_in_the_other_tenant(client_for, outsider, tenant):
    response = client_for(outsider).post("/api/v1/environments/", {"tenant": "acme", "name": "sneaky"})
    assert response.status_code == 400
    assert "tenant" in response.json()
    assert not Environment.objects.filter(tenant=tenant).exists()


def test_a_teammate_sees_the_tenants_environments(client_for, teammate, environment):
    response = client_for(teammate).get(f"/api/v1/environments/{environment.id}/")
    assert response.status_code == 200
    assert response.json()["namespace"] == "acme-train"


def test_staff_see_every_tenant(client_for, staff, tenant, other_tenant):
    slugs = [t["slug"] for t in client_for(staff).get("/api/v1/tenants/").json()["results"]]
    assert slugs == ["acme", "globex"]


def test_a_subclass_cannot_replace_the_scoped_queryset():
    from tenants.scoping import TenantScopedMixin

    with pytest.raises(TypeError, match="skip tenant scoping"):

        class Leaky(TenantScopedMixin):
            def get_queryset(self):
                return Environment.objects.all()
