"""API tokens: issued for a password, stored hashed, expiring and revocable."""

from datetime import timedelta

import pytest
from django.utils import timezone
from knox.models import AuthToken
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.test import APIClient

from tenants.auth import TokenAuthentication
from tenants.models import TokenInfo
from tests.conftest import PASSWORD
from tests.support.worker import clear_cache

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


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
    settings.API_LOGIN_RATE = "2/min"
    clear_cache()
    yield
    clear_cache()


def test_logins_are_limited_per_address_even_for_callers_with_a_token(owner, two_logins_a_minute):
    _, token = AuthToken.objects.create(owner)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    codes = [client.post("/api/v1/auth/token/", {"username": f"user{i}", "password": "guess"}).status_code for i in range(4)]
    assert codes == [401, 401, 429, 429]


def test_a_username_under_attack_cools_down_only_for_addresses_that_have_been_failing(owner, two_logins_a_minute):
    def login(address, password="guess"):
        client = APIClient(REMOTE_ADDR=address)
        return client.post("/api/v1/auth/token/", {"username": "olivia", "password": password}).status_code

    # Two wrong guesses from two addresses put the username in its cool-down.
    assert [login("10.0.0.1"), login("10.0.0.2")] == [401, 401]
    # An address that has been failing gets no more guesses at it, even the right password...
    assert login("10.0.0.1") == 429
    assert login("10.0.0.2", PASSWORD) == 429
    # ...while the owner, from an address that has not been failing, still gets a token:
    # strangers cannot lock a user out of the API by guessing.
    assert login("10.0.0.9", PASSWORD) == 201
    # A guesser spread over many addresses gets one guess per fresh address, then 429.
    assert [login("10.0.0.3"), login("10.0.0.3")] == [401, 429]


def test_an_expired_token_is_swept_by_its_owners_next_request_and_left_out_of_the_list(owner):
    expired, token = AuthToken.objects.create(owner, expiry=timedelta(hours=1))
    AuthToken.objects.filter(pk=expired.pk).update(expiry=timezone.now() - timedelta(seconds=1))
    _, current = AuthToken.objects.create(owner)
    for number, made in enumerate(AuthToken.objects.all()):
        TokenInfo.objects.create(token=made, name=f"token {number}")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {current}")
    listed = client.get("/api/v1/tokens/").json()
    assert [row["current"] for row in (listed["results"] if isinstance(listed, dict) else listed)] == [True]
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.get("/api/v1/tenants/").status_code == 401
    assert not AuthToken.objects.filter(pk=expired.pk).exists()


@pytest.mark.parametrize("sent", [b"", b"not-hex-at-all", b"\xff\xfe", b"ab" * 80])
def test_a_malformed_token_is_refused(owner, sent):
    with pytest.raises(AuthenticationFailed):
        TokenAuthentication().authenticate_credentials(sent)
