"""A server error names the request id its log lines carry; the API never answers with Django's debug page."""

import pytest
from django.test import Client

pytestmark = [pytest.mark.integration, pytest.mark.urls("tests.portal.error_urls")]


@pytest.mark.parametrize("debug", [True, False])
def test_a_failing_api_call_is_json_with_the_request_id_whatever_debug_is(settings, debug, db):
    settings.DEBUG = debug
    response = Client(raise_request_exception=False).get("/api/v1/broken/", HTTP_ACCEPT="text/html")
    assert response.status_code == 500
    assert response["Content-Type"].startswith("application/json")
    body = response.json()
    assert body["request_id"] == response["X-Request-ID"] and body["request_id"]
    assert "Traceback" not in response.content.decode() and "RuntimeError" not in response.content.decode()


@pytest.mark.parametrize("debug", [True, False])
def test_a_failing_page_is_the_portal_s_500_page_showing_the_request_id(settings, debug, db):
    settings.DEBUG = debug
    response = Client(raise_request_exception=False).get("/broken/", HTTP_X_REQUEST_ID="0123456789abcdef0123456789abcdef")
    text = response.content.decode()
    assert response.status_code == 500
    assert "Something went wrong on our side" in text and "Traceback" not in text
    assert response["X-Request-ID"] == "0123456789abcdef0123456789abcdef"
    assert "0123456789abcdef0123456789abcdef" in text
