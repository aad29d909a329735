"""/api/v1/tokens/: your API tokens, named, expiring, last used noted, revocable; nobody else's."""

from datetime import timedelta

import pytest
from django.db.models.signals import post_init
from django.utils import timezone
from knox.models import AuthToken
from rest_framework.test import APIClient

from tenants.models import TokenInfo
from tests.conftest import PASSWORD

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


def token_client(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client


def test_a_token_is_created_with_a_name_and_expiry_and_its_secret_shown_once(owner, client_for):
    api = client_for(owner)
    response = api.post("/api/v1/tokens/", {"name": "CI", "expires_in_days": 7}, format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["name"] == "CI" and body["user"] == "olivia" and body["last_used_at"] is None
    expiry = timezone.datetime.fromisoformat(body["expiry"])
    assert timedelta(days=6, hours=23) < expiry - timezone.now() <= timedelta(days=7)
    secret = body["token"]

    assert token_client(secret).get("/api/v1/tenants/").status_code == 200
    listed = api.get("/api/v1/tokens/").json()["results"]
    assert [t["name"] for t in listed] == ["CI", "test client"]
    assert "token" not in listed[0] and secret not in str(listed)
    stored = AuthToken.objects.get(info__name="CI")
    assert secret not in (stored.digest, stored.token_key)


def test_last_used_and_current_are_reported(owner):
    token = APIClient().post("/api/v1/auth/token/", {"username": "olivia", "password": PASSWORD}).json()["token"]
    api = token_client(token)
    [listed] = api.get("/api/v1/tokens/").json()["results"]
    assert listed["name"] == "password login" and listed["current"] is True
    assert listed["last_used_at"] is not None  # this very request used it
    before = TokenInfo.objects.get().last_used_at
    api.get("/api/v1/tenants/")
    assert TokenInfo.objects.get().last_used_at == before  # noted to the minute, not at every request
    TokenInfo.objects.update(last_used_at=timezone.now() - timedelta(minutes=5))
    api.get("/api/v1/tenants/")
    assert timezone.now() - TokenInfo.objects.get().last_used_at < timedelta(seconds=30)


def test_a_request_reads_only_the_expired_tokens_of_its_user_and_an_expired_token_is_refused(owner):
    def tokens_read(token: str) -> int:
        """Token rows one request reads (a page that lists no tokens: what it reads is its authentication's)."""
        read = []

        def note(sender, instance, **kwargs):
            read.append(instance)

        post_init.connect(note, sender=AuthToken)
        try:
            assert token_client(token).get("/api/v1/tenants/").status_code == 200
        finally:
            post_init.disconnect(note, sender=AuthToken)
        return len(read)

    _, secret = AuthToken.objects.create(owner)
    for _ in range(40):
        AuthToken.objects.create(owner)
    assert tokens_read(secret) == 1  # its own, not the user's 41
    stale, _ = AuthToken.objects.create(owner)
    AuthToken.objects.filter(pk=stale.pk).update(expiry=timezone.now() - timedelta(seconds=1))
    live = AuthToken.objects.count() - 1
    token_client(secret).get("/api/v1/tokens/")
    assert AuthToken.objects.count() == live  # another expired token of the user is deleted, the live ones kept
    expired, gone = AuthToken.objects.create(owner)
    AuthToken.objects.filter(pk=expired.pk).update(expiry=timezone.now() - timedelta(seconds=1))
    assert token_client(gone).get("/api/v1/tokens/").status_code == 401
    assert not AuthToken.objects.filter(pk=expired.pk).exists()


def test_revoked_tokens_stop_working_and_another_users_token_is_a_404(owner, teammate, client_for):
    mine = client_for(owner).post("/api/v1/tokens/", {"name": "laptop"}, format="json").json()
    theirs = client_for(teammate).post("/api/v1/tokens/", {"name": "theirs"}, format="json").json()

    assert client_for(owner).delete(f"/api/v1/tokens/{theirs['id']}/").status_code == 404
    assert token_client(theirs["token"]).get("/api/v1/tenants/").status_code == 200
    # Only staff may ask for another user's: anyone else gets their own.
    assert "theirs" not in str(client_for(owner).get("/api/v1/tokens/?user=tom").json()["results"])

    assert client_for(owner).delete(f"/api/v1/tokens/{mine['id']}/").status_code == 204
    assert token_client(mine["token"]).get("/api/v1/tenants/").status_code == 401
    assert client_for(owner).delete(f"/api/v1/tokens/{mine['id']}/").status_code == 404
    assert client_for(owner).delete("/api/v1/tokens/nope/").status_code == 404
    assert client_for(owner).delete(f"/api/v1/tokens/{10**20}/").status_code == 404
    assert not TokenInfo.objects.filter(id=mine["id"]).exists()


def test_staff_list_and_revoke_anyones(owner, staff, client_for):
    theirs = client_for(owner).post("/api/v1/tokens/", {"name": "CI"}, format="json").json()
    listed = client_for(staff).get("/api/v1/tokens/?user=olivia").json()["results"]
    assert [(t["name"], t["user"]) for t in listed] == [("CI", "olivia"), ("test client", "olivia")]
    assert {t["user"] for t in client_for(staff).get("/api/v1/tokens/").json()["results"]} == {"sam"}  # their own
    assert client_for(staff).delete(f"/api/v1/tokens/{theirs['id']}/").status_code == 204
    assert token_client(theirs["token"]).get("/api/v1/tenants/").status_code == 401


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "name"),
        ({"name": ""}, "name"),
        ({"name": "   "}, "name"),
        ({"name": "x" * 101}, "name"),
        ({"name": 5}, "name"),
        ({"name": "ok", "expires_in_days": 0}, "expires_in_days"),
        ({"name": "ok", "expires_in_days": 366}, "expires_in_days"),
        ({"name": "ok", "expires_in_days": "soon"}, "expires_in_days"),
        ({"name": "ok", "expires_in_days": True}, "expires_in_days"),
        ({"name": "ok", "scope": "all"}, "scope"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_makes_no_token(owner, client_for, body, field):
    api = client_for(owner)
    response = api.post("/api/v1/tokens/", body, format="json")
    assert response.status_code == 400 and field in response.json(), response.json()
    assert AuthToken.objects.count() == TokenInfo.objects.count() == 1  # the client's own


def test_anonymous_callers_get_nothing(owner):
    assert APIClient().get("/api/v1/tokens/").status_code in (401, 403)
    assert APIClient().post("/api/v1/tokens/", {"name": "x"}, format="json").status_code in (401, 403)
