"""A tenant's choice about moves (Tenant.allow_moves): the scheduler may stop its preemptible jobs with a checkpoint
and resume them on another node to make room (runners.scheduling.defrag). Admins set it, through the API and on the
tenant's page; the scheduler's side is tests/scheduling/test_cycle_defrag.py."""

import pytest

from audit.models import AuditEntry

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


def test_an_admin_turns_moves_off_and_on_through_the_api_and_each_change_is_audited(client_for, owner, tenant):
    api = client_for(owner)
    assert api.get("/api/v1/tenants/acme/").json()["allow_moves"] is True
    response = api.patch("/api/v1/tenants/acme/", {"allow_moves": False}, format="json")
    assert response.status_code == 200 and response.json()["allow_moves"] is False
    tenant.refresh_from_db()
    assert tenant.allow_moves is False
    entry = AuditEntry.objects.get(action="tenant.moves_set")
    assert (entry.before, entry.after) == ({"allow_moves": True}, {"allow_moves": False})
    # The same value again changes nothing and records nothing.
    assert api.patch("/api/v1/tenants/acme/", {"allow_moves": False}, format="json").status_code == 200
    assert AuditEntry.objects.filter(action="tenant.moves_set").count() == 1
    assert api.patch("/api/v1/tenants/acme/", {"allow_moves": True}, format="json").json()["allow_moves"] is True


@pytest.mark.parametrize("body", [{}, {"allow_moves": "maybe"}, {"allow_moves": None}, {"allow_moves": 1}])
def test_bad_input_is_a_400_that_names_the_field(client_for, owner, tenant, body):
    response = client_for(owner).patch("/api/v1/tenants/acme/", body, format="json")
    assert response.status_code == 400 and "allow_moves" in response.json(), response.json()
    tenant.refresh_from_db()
    assert tenant.allow_moves is True


def test_a_member_may_not_and_another_tenant_sees_nothing(client_for, teammate, outsider, tenant):
    assert client_for(teammate).patch("/api/v1/tenants/acme/", {"allow_moves": False}, format="json").status_code == 403
    assert client_for(outsider).patch("/api/v1/tenants/acme/", {"allow_moves": False}, format="json").status_code == 404
    tenant.refresh_from_db()
    assert tenant.allow_moves is True


def test_the_tenant_page_says_where_moves_stand_and_lets_an_admin_change_it(client, owner, teammate, outsider, tenant):
    client.force_login(owner)
    assert "may be moved" in client.get("/tenants/acme/").content.decode()
    page = client.post("/tenants/acme/moves/", {"allow_moves": "false"}, follow=True).content.decode()
    assert "are never moved" in page and "will never move this tenant" in page
    tenant.refresh_from_db()
    assert tenant.allow_moves is False
    assert "Could not change moves" in client.post("/tenants/acme/moves/", {"allow_moves": "no"}, follow=True).content.decode()
    client.force_login(teammate)
    page = client.get("/tenants/acme/").content.decode()
    assert "are never moved" in page and "Allow moves" not in page, "only admins see the button"
    assert "Could not change moves" in client.post("/tenants/acme/moves/", {"allow_moves": "true"}, follow=True).content.decode()
    client.force_login(outsider)
    assert client.post("/tenants/acme/moves/", {"allow_moves": "true"}).status_code == 404
    tenant.refresh_from_db()
    assert tenant.allow_moves is False
