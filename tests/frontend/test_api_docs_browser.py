"""The API docs page in Chromium with every request that does not go to the portal refused."""

import pytest

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_api_docs_render_with_nothing_but_the_portal_reachable(page, live_server, screenshot_dir):
    refused = []

    def only_the_portal(route):
        if route.request.url.startswith(live_server.url):
            route.continue_()
        else:
            refused.append(route.request.url)
            route.abort()

    page.route("**/*", only_the_portal)
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: errors.append(message.text) if "Content Security Policy" in message.text else None)
    response = page.goto(f"{live_server.url}/api/docs/")
    assert "script-src 'self'" in response.headers["content-security-policy"]
    # Swagger UI drew the schema's operations: its bundle and the schema came from the portal.
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("GPU portal API")
    expect(page.locator(".opblock-tag-section").first).to_be_visible()
    expect(page.get_by_text("/api/v1/jobs/", exact=True).first).to_be_attached()
    page.screenshot(path=str(screenshot_dir / "api-docs-offline.png"), full_page=False)
    assert errors == [], errors
    assert refused == [], f"the page asked for something outside the portal: {refused}"
