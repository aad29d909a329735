"""Browser pages through Django's test client: rendering, scoping, forms and permissions."""

import pytest
from django.urls import reverse

from runners.environments import services as environments
from runners.environments.models import Environment, EnvironmentState
from tenants.models import Membership
from tests.conftest import PASSWORD

pytestmark = pytest.mark.integration


@pytest.fixture
def environment(owner, tenant):
    return environments.environment_request(actor=owner, tenant=tenant, name="train")


@pytest.fixture
def foreign_environment(outsider, other_tenant):
    return environments.environment_request(actor=outsider, tenant=other_tenant, name="secret")


def _logged_in(client, user):
    client.force_login(user)
    return client


def _messages(response) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def _set_state(environment, state):
    Environment.objects.filter(id=environment.id).update(state=state)


# --- Rendering --------------------------------------------------------------


def test_dashboard_lists_my_tenants_and_environments_with_their_states(client, owner, environment):
    response = _logged_in(client, owner).get("/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "Acme ML" in html and "train" in html and "requested" in html
    assert 'data-testid="current-user">olivia<' in html
    assert reverse("api-docs") in html


def test_tenant_page_shows_members_environments_and_the_new_environment_form(client, owner, teammate, environment):
    response = _logged_in(client, owner).get("/tenants/acme/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "olivia" in html and "tom" in html
    assert f'id="environment-row-{environment.id}"' in html
    assert 'data-testid="new-environment"' in html
    assert 'data-testid="add-member"' in html


def test_environment_page_shows_its_state_and_polls_while_transitional(client, owner, environment):
    response = _logged_in(client, owner).get(f"/environments/{environment.id}/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "acme--train" in html
    assert f'data-poll-url="/environments/{environment.id}/status/"' in html
    assert f"/environments/{environment.id}/delete/" in html


def test_status_fragment_stops_polling_once_the_environment_is_ready(client, owner, environment):
    _logged_in(client, owner)
    assert b"data-poll-url" in client.get(f"/environments/{environment.id}/status/").content
    _set_state(environment, EnvironmentState.READY)
    response = client.get(f"/environments/{environment.id}/status/")
    assert response.status_code == 200
    assert b"ready" in response.content
    assert b"data-poll-url" not in response.content, "a settled environment must stop the polling"
    assert "<html" not in response.content.decode(), "the fragment is a fragment, not a page"


def test_row_fragment_keeps_the_tenant_column_when_asked(client, owner, environment):
    response = _logged_in(client, owner).get(f"/environments/{environment.id}/row/?show_tenant=1")
    assert response.status_code == 200
    assert b"Acme ML" in response.content
    assert b"?show_tenant=1" in response.content


def test_row_fragment_is_empty_once_deleted_so_the_row_goes_away(client, owner, environment):
    _set_state(environment, EnvironmentState.DELETED)
    response = _logged_in(client, owner).get(f"/environments/{environment.id}/row/")
    assert response.status_code == 200
    assert response.content.strip() == b""


def test_staff_see_an_admin_link_and_others_do_not(client, owner, staff, tenant):
    assert reverse("admin:index").encode() not in _logged_in(client, owner).get("/").content
    response = _logged_in(client, staff).get("/")
    assert reverse("admin:index").encode() in response.content
    assert b"Acme ML" in response.content, "staff see every tenant"


# --- Authentication -----------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/", "/tenants/acme/", "/environments/1/", "/environments/1/status/", "/environments/1/row/"]
)
def test_pages_redirect_to_login_when_logged_out(client, path):
    response = client.get(path)
    assert response.status_code == 302
    assert response.url.startswith(reverse("login"))


def test_login_page_renders_and_a_logged_in_user_skips_it(client, owner):
    response = client.get("/login/")
    assert response.status_code == 200
    assert b'name="username"' in response.content and b'name="password"' in response.content
    assert _logged_in(client, owner).get("/login/").url == reverse("dashboard")


def test_login_with_a_password_lands_on_the_dashboard(client, owner):
    response = client.post("/login/", {"username": "olivia", "password": PASSWORD}, follow=True)
    assert response.redirect_chain[-1][0] == reverse("dashboard")
    assert b"Acme ML" in response.content


def test_login_with_a_wrong_password_says_so(client, owner):
    response = client.post("/login/", {"username": "olivia", "password": "wrong"})
    assert response.status_code == 200
    assert b"Please enter a correct username and password" in response.content


def test_logout_is_a_post_form(client, owner):
    _logged_in(client, owner)
    html = client.get("/").content.decode()
    assert f'method="post" action="{reverse("logout")}"' in html
    assert client.post("/logout/").status_code == 302
    assert client.get("/").status_code == 302, "logged out, the dashboard asks for a login again"


# --- Scoping ----------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/tenants/globex/",
        "/environments/{id}/",
        "/environments/{id}/status/",
        "/environments/{id}/row/",
        "/environments/{id}/delete/",
    ],
)
def test_outsider_gets_404_on_another_tenants_pages(client, owner, tenant, foreign_environment, path):
    response = _logged_in(client, owner).get(path.format(id=foreign_environment.id))
    assert response.status_code == 404


def test_outsider_cannot_create_delete_or_add_members_in_another_tenant(client, outsider, owner, environment):
    _logged_in(client, outsider)
    assert client.post("/tenants/acme/environments/new/", {"name": "sneaky"}).status_code == 404
    assert client.post(f"/environments/{environment.id}/delete/").status_code == 404
    assert client.post("/tenants/acme/members/new/", {"username": "oscar", "role": "owner"}).status_code == 404
    assert client.post("/tenants/acme/members/olivia/remove/").status_code == 404
    environment.refresh_from_db()
    assert environment.state == EnvironmentState.REQUESTED
    assert not Environment.objects.filter(name="sneaky").exists()
    assert Membership.objects.filter(tenant__slug="acme").count() == 1


def test_dashboard_does_not_show_another_tenants_environments(client, owner, tenant, foreign_environment):
    html = _logged_in(client, owner).get("/").content.decode()
    assert "secret" not in html and "Globex" not in html


# --- Creating environments ----------------------------------------------------


def test_creating_an_environment_through_the_form_creates_it(client, owner, tenant):
    response = _logged_in(client, owner).post("/tenants/acme/environments/new/", {"name": "train"}, follow=True)
    environment = Environment.objects.get(tenant=tenant, name="train")
    assert environment.state == EnvironmentState.REQUESTED and environment.created_by == owner
    assert response.redirect_chain[-1][0] == f"/environments/{environment.id}/"
    assert any("Requested train" in message for message in _messages(response))


def test_a_bad_name_shows_the_error_next_to_the_field_and_creates_nothing(client, owner, tenant):
    response = _logged_in(client, owner).post("/tenants/acme/environments/new/", {"name": "Bad_Name"})
    assert response.status_code == 400
    html = response.content.decode()
    assert 'id="id_name-errors"' in html
    assert "DNS-1123 label" in html
    assert 'value="Bad_Name"' in html, "the form keeps what was typed"
    assert not Environment.objects.exists()


def test_a_duplicate_name_shows_the_service_error_next_to_the_field(client, owner, environment):
    response = _logged_in(client, owner).post("/tenants/acme/environments/new/", {"name": "train"})
    assert response.status_code == 400
    assert response.context["environment_form"].errors["name"] == [
        "Tenant acme already has an environment named 'train'."
    ]
    assert Environment.objects.count() == 1


def test_a_name_too_long_for_the_namespace_is_named_as_the_problem(client, owner, tenant):
    response = _logged_in(client, owner).post("/tenants/acme/environments/new/", {"name": "x" * 33})
    assert response.status_code == 400
    assert "at most 32 characters" in response.context["environment_form"].errors["name"][0]
    assert not Environment.objects.exists()


def test_viewer_sees_no_create_or_delete_controls(client, viewer, environment):
    _logged_in(client, viewer)
    tenant_html = client.get("/tenants/acme/").content.decode()
    assert 'data-testid="new-environment"' not in tenant_html
    assert 'data-testid="add-member"' not in tenant_html
    assert "Remove</button>" not in tenant_html
    environment_html = client.get(f"/environments/{environment.id}/").content.decode()
    assert f"/environments/{environment.id}/delete/" not in environment_html


def test_viewer_cannot_create_an_environment_and_is_told_why(client, viewer, tenant):
    response = _logged_in(client, viewer).post("/tenants/acme/environments/new/", {"name": "train"}, follow=True)
    assert response.status_code == 200
    assert not Environment.objects.exists()
    assert any("needs the member role" in message for message in _messages(response))


def test_viewer_cannot_delete_an_environment_and_is_told_why(client, viewer, environment):
    response = _logged_in(client, viewer).post(f"/environments/{environment.id}/delete/", follow=True)
    assert response.status_code == 200
    environment.refresh_from_db()
    assert environment.state == EnvironmentState.REQUESTED
    assert any("needs the member role" in message for message in _messages(response))


# --- Deleting environments ----------------------------------------------------


def test_delete_asks_for_confirmation_and_deletes_only_on_post(client, owner, environment):
    _logged_in(client, owner)
    confirm = client.get(f"/environments/{environment.id}/delete/")
    assert confirm.status_code == 200
    assert b"Delete train?" in confirm.content and b'method="post"' in confirm.content
    environment.refresh_from_db()
    assert environment.state == EnvironmentState.REQUESTED, "a GET must not delete anything"

    response = client.post(f"/environments/{environment.id}/delete/", follow=True)
    assert response.redirect_chain[-1][0] == "/tenants/acme/"
    environment.refresh_from_db()
    assert environment.state == EnvironmentState.DELETING
    assert f'data-poll-url="/environments/{environment.id}/row/"' in response.content.decode()


def test_a_deleted_environment_disappears_from_the_lists(client, owner, environment):
    _set_state(environment, EnvironmentState.DELETED)
    _logged_in(client, owner)
    assert f"environment-row-{environment.id}" not in client.get("/").content.decode()
    assert f"environment-row-{environment.id}" not in client.get("/tenants/acme/").content.decode()


# --- Members ----------------------------------------------------------------


def test_owner_adds_and_removes_a_member(client, owner, tenant, make_user):
    make_user("alex")
    _logged_in(client, owner)
    response = client.post("/tenants/acme/members/new/", {"username": "alex", "role": "admin"}, follow=True)
    assert Membership.objects.get(tenant=tenant, user__username="alex").role == "admin"
    assert "Added alex as admin." in _messages(response)

    response = client.post("/tenants/acme/members/alex/remove/", follow=True)
    assert not Membership.objects.filter(tenant=tenant, user__username="alex").exists()
    assert "Removed alex from Acme ML." in _messages(response)


def test_adding_an_unknown_user_names_the_problem_next_to_the_field(client, owner, tenant):
    response = _logged_in(client, owner).post("/tenants/acme/members/new/", {"username": "nobody", "role": "member"})
    assert response.status_code == 400
    assert response.context["member_form"].errors["username"] == ["There is no user named 'nobody'."]
    assert b'id="id_username-errors"' in response.content


def test_an_admin_cannot_grant_owner_and_is_told_why(client, make_user, tenant):
    admin = make_user("ada")
    Membership.objects.create(user=admin, tenant=tenant, role="admin")
    make_user("alex")
    response = _logged_in(client, admin).post(
        "/tenants/acme/members/new/", {"username": "alex", "role": "owner"}, follow=True
    )
    assert not Membership.objects.filter(user__username="alex").exists()
    assert any("Granting owner needs the owner role" in message for message in _messages(response))


def test_the_last_owner_cannot_be_removed_and_the_page_says_why(client, owner, tenant):
    response = _logged_in(client, owner).post("/tenants/acme/members/olivia/remove/", follow=True)
    assert Membership.objects.filter(tenant=tenant, user=owner).exists()
    assert any("last owner" in message for message in _messages(response))


def test_a_member_removed_by_themselves_lands_on_the_dashboard(client, owner, tenant, make_user):
    admin = make_user("ada")
    Membership.objects.create(user=admin, tenant=tenant, role="admin")
    response = _logged_in(client, admin).post("/tenants/acme/members/ada/remove/")
    assert response.url == reverse("dashboard")
    assert not Membership.objects.filter(user=admin).exists()


def test_a_plain_member_sees_no_member_management_and_is_refused(client, teammate, owner, tenant):
    _logged_in(client, teammate)
    assert b'data-testid="add-member"' not in client.get("/tenants/acme/").content
    response = client.post("/tenants/acme/members/olivia/remove/", follow=True)
    assert response.status_code == 200
    assert Membership.objects.filter(tenant=tenant, user=owner).exists()
    assert any("needs the admin role" in message for message in _messages(response))
