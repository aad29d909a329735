"""API tokens: issued for a password, stored hashed, expiring and revocable."""

from datetime import timedelta

import pytest
from django.utils import timezone
from knox.models import AuthToken
from rest_framework.test import APIClient

from tests.conftest import PASSWORD

pytestmark = pytest.mark.django_db


def test_it_issues_a_token_for_a_correct_password(owner):
    response = APIClient().post("/api/v1/auth/token/", {"username": "olivia", "password": PASSWORD})
    assert response.status_code == 201
    token = response.json()["token"]
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.get("/api/v1/tenants/").status_code == 200


def test_it_stores_only_a_hash_of_the_token(owner):
    token = APIClient().post("/api/v1/auth/token/", {"username": "olivia", "password": PASSWORD}).json()["token"]
    stored = AuthToken.objects.get(user=owner)
    assert token not in (stored.digest, stored.token_key)
    assert stored.token_key == token[: len(stored.token_key)]


def test_it_refuses_a_wrong_password(owner):
    response = APIClient().post("/api/v1/auth/token/", {"username": "olivia", "password": "nope"})
    assert response.status_code in (401, 403)
    assert not AuthToken.objects.exists()


def test_it_names_a_missing_field(owner):
    response = APIClient().post("/api/v1/auth/token/", {"username": "olivia"})
    assert response.status_code == 400
    assert "password" in response.json()


def test_an_expired_token_is_refused(owner):
    instance, token = AuthToken.objects.create(owner, expiry=timedelta(hours=1))
    AuthToken.objects.filter(pk=instance.pk).update(expiry=timezone.now() - timedelta(seconds=1))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.get("/api/v1/tenants/").status_code == 401


def test_a_revoked_token_stops_working(owner):
    _, token = AuthToken.objects.create(owner)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.delete("/api/v1/auth/token/").status_code == 204
    assert client.get("/api/v1/tenants/").status_code == 401


def test_anonymous_requests_are_refused():
    assert APIClient().get("/api/v1/environments/").status_code in (401, 403)


@pytest.fixture
def two_logins_a_minute(settings):
    from django.core.cache import cache

    settings.API_LOGIN_RATE = "2/min"
    cache.clear()
    yield
    cache.clear()


def test_logins_are_limited_per_address_even_for_callers_with_a_token(owner, two_logins_a_minute):
    _, token = AuthToken.objects.create(owner)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    codes = [client.post("/api/v1/auth/token/", {"username": f"user{i}", "password": "guess"}).status_code for i in range(4)]
    assert codes == [401, 401, 429, 429]


def test_logins_for_one_username_are_limited_from_any_address(owner, two_logins_a_minute):
    codes = [
        APIClient(REMOTE_ADDR=f"10.0.0.{i}").post("/api/v1/auth/token/", {"username": "olivia", "password": "guess"}).status_code
        for i in range(4)
    ]
    assert codes == [401, 401, 429, 429]
