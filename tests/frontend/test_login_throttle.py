"""The browser's login page and the admin's share the API's login throttle."""

import pytest
from django.test import Client
from rest_framework.test import APIClient

from tests.conftest import PASSWORD
from tests.support.worker import clear_cache

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture(autouse=True)
def thirty_logins_a_minute(settings):
    settings.API_LOGIN_RATE = "30/min"
    clear_cache()
    yield
    clear_cache()


def _signed_in(client: Client) -> bool:
    return "_auth_user_id" in client.session


def test_a_hundred_wrong_passwords_at_the_login_page_are_throttled_and_the_right_one_then_too(owner):
    client = Client(REMOTE_ADDR="203.0.113.7")
    codes = [client.post("/login/", {"username": "olivia", "password": f"guess-{i}"}).status_code for i in range(100)]
    assert codes[:30] == [200] * 30, "wrong passwords re-show the form"
    assert set(codes[30:]) == {429}, "past the rate the page refuses to check passwords"
    response = client.post("/login/", {"username": "olivia", "password": PASSWORD})
    assert response.status_code == 429
    assert int(response["Retry-After"]) >= 1
    assert "Too many login attempts" in response.content.decode()
    assert not _signed_in(client)


def test_forty_wrong_passwords_at_the_admin_login_are_throttled(staff):
    client = Client(REMOTE_ADDR="203.0.113.8")
    codes = [client.post("/admin/login/", {"username": "sam", "password": f"guess-{i}"}).status_code for i in range(40)]
    assert codes[:30] == [200] * 30
    assert set(codes[30:]) == {429}
    response = client.post("/admin/login/", {"username": "sam", "password": PASSWORD})
    assert response.status_code == 429
    assert not _signed_in(client)


def test_the_api_and_the_pages_count_against_one_budget(owner):
    api = APIClient(REMOTE_ADDR="203.0.113.9")
    for i in range(30):
        api.post("/api/v1/auth/token/", {"username": f"someone-{i}", "password": "guess"})
    assert Client(REMOTE_ADDR="203.0.113.9").post("/login/", {"username": "olivia", "password": PASSWORD}).status_code == 429


def test_a_stranger_guessing_cannot_lock_the_user_out_of_the_login_page(owner):
    stranger = Client(REMOTE_ADDR="198.51.100.1")
    for i in range(40):
        stranger.post("/login/", {"username": "olivia", "password": f"guess-{i}"})
    assert stranger.post("/login/", {"username": "olivia", "password": PASSWORD}).status_code == 429
    user = Client(REMOTE_ADDR="192.0.2.50")
    response = user.post("/login/", {"username": "olivia", "password": PASSWORD})
    assert response.status_code == 302
    assert _signed_in(user)


def test_below_the_rate_the_right_password_signs_in_after_a_typo(owner):
    client = Client(REMOTE_ADDR="192.0.2.60")
    assert client.post("/login/", {"username": "olivia", "password": "typo"}).status_code == 200
    assert client.post("/login/", {"username": "olivia", "password": PASSWORD}).status_code == 302
    assert _signed_in(client)
