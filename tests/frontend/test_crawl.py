"""Every link a person can click, followed as each role with DEBUG on (as `make run` has it):
no 500, no traceback, no URL list; a missing or forbidden page is the portal's own friendly page."""

import pytest
from django.test import Client

from tenants.models import Tenant
from tests.support.crawl import crawl
from tests.support.jobs import demo_with_jobs

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def world(settings):
    settings.DEBUG = True  # as `make run` has it
    return demo_with_jobs()


def _fetch(client: Client):
    def fetch(path: str) -> tuple[int, dict, str]:
        response = client.get(path)
        return response.status_code, response.headers, response.content.decode(errors="replace")

    return fetch


@pytest.mark.parametrize("username", [None, "bob", "alice", "carol", "admin"])
def test_every_link_as_each_role_answers_without_a_server_error_or_a_debug_page(world, username):
    client = Client()
    if username:
        client.force_login(world.get(username=username))
    seen, problems = crawl(_fetch(client), "/" if username else "/login/")
    assert problems == [], "\n".join(problems)
    assert len(seen) >= (3 if username is None else 8), seen
    if username == "admin":
        assert any(path.startswith("/admin/") for path in seen) and any(path.startswith("/jobs/") for path in seen)


def test_a_missing_page_and_another_tenants_object_are_the_friendly_404(world):
    client = Client()
    client.force_login(world.get(username="alice"))
    vision_environment = Tenant.objects.get(slug="vision").environments.get().id
    for path in ("/no/such/page/", f"/environments/{vision_environment}/", "/jobs/999999/", "/tenants/vision/"):
        response = client.get(path)
        text = response.content.decode()
        assert response.status_code == 404, path
        assert "Page not found" in text and "URLconf" not in text and "Back to the dashboard" in text, path
    # The API keeps its JSON answers.
    assert client.get("/api/v1/no-such-thing/").status_code == 404


def test_a_stale_form_is_a_friendly_403_that_says_so(world):
    client = Client(enforce_csrf_checks=True)
    client.force_login(world.get(username="alice"))
    response = client.post("/tokens/new/", {"name": "x", "expires_in_days": 3})
    assert response.status_code == 403
    assert "The form had expired" in response.content.decode()
