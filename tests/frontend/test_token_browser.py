"""API tokens in the browser: a member creates one, uses it against the API, and revokes it."""

import json
import urllib.error
import urllib.request

import pytest

from tests.frontend.conftest import log_in, snap

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def call_api(live_server, token: str) -> int:
    request = urllib.request.Request(f"{live_server.url}/api/v1/tenants/", headers={"Authorization": f"Token {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert json.load(answer)["results"][0]["slug"] == "acme"
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code


def test_a_member_creates_uses_and_revokes_a_token(page, live_server, teammate, screenshot_dir):
    log_in(page, live_server, "tom")
    page.get_by_role("navigation").get_by_role("link", name="API tokens").click()
    expect(page.get_by_text("No tokens yet.")).to_be_visible()

    form = page.get_by_test_id("new-token-form")
    form.get_by_role("button", name="Create token").click()  # no name: one round, the field named
    expect(page.get_by_test_id("new-token-form").locator("#id_name-errors")).to_be_visible()
    form = page.get_by_test_id("new-token-form")
    form.get_by_label("Name").fill("laptop")
    form.get_by_label("Expires in (days)").fill("7")
    form.get_by_role("button", name="Create token").click()

    secret = page.get_by_test_id("token-secret").inner_text().strip()
    assert len(secret) >= 40
    snap(page, screenshot_dir / "tokens-created.png")
    row = page.get_by_test_id("tokens").get_by_role("row", name="laptop")
    expect(row.get_by_test_id("last-used")).to_have_text("never")

    assert call_api(live_server, secret) == 200
    page.get_by_role("navigation").get_by_role("link", name="API tokens").click()
    expect(page.get_by_test_id("token-secret")).to_have_count(0)  # shown once, never again
    row = page.get_by_test_id("tokens").get_by_role("row", name="laptop")
    expect(row.get_by_test_id("last-used")).not_to_have_text("never")

    row.get_by_role("button", name="Revoke laptop").click()
    expect(page.get_by_role("status")).to_contain_text("Revoked the token 'laptop'")
    expect(page.get_by_text("No tokens yet.")).to_be_visible()
    assert call_api(live_server, secret) == 401
