"""A body sent chunked (Transfer-Encoding: chunked, no Content-Length), through gunicorn as the portal serves.

Django reads a request's body by its Content-Length, so a chunked one was read as empty: a submit
answered 400 "this field is required" for fields it held, and a chunked body of any size never
got the 413 that one with a Content-Length over REQUEST_MAX_BODY_BYTES gets.
"""

import json

import pytest
import requests

from runners.environments.models import Environment
from tests.faults import support

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

LIMIT = 4096


def _chunks(body: bytes, size: int = 1000):
    """A generator body: requests sends it chunked, with no Content-Length."""
    for start in range(0, len(body), size):
        yield body[start:start + size]


@pytest.fixture
def web(tmp_path):
    server = support.Gunicorn(tmp_path / "web.log", workers=1, REQUEST_MAX_BODY_BYTES=LIMIT, API_MAX_BODY_BYTES=LIMIT)
    server.start()
    yield server
    server.stop()


def test_a_chunked_body_is_read_and_one_over_the_limit_is_a_413(web, tenant, owner):
    session = requests.Session()
    session.headers.update({"Authorization": f"Token {support.api_token(owner)}", "Content-Type": "application/json"})
    url = f"{web.url}/api/v1/environments/"

    body = json.dumps({"tenant": tenant.slug, "name": "chunked"}).encode()
    created = session.post(url, data=_chunks(body, 7), timeout=30)
    assert created.request.headers.get("Transfer-Encoding") == "chunked" and "Content-Length" not in created.request.headers
    assert created.status_code == 201, created.text
    assert Environment.objects.filter(tenant=tenant, name="chunked").count() == 1

    too_big = json.dumps({"tenant": tenant.slug, "name": "big", "padding": "x" * (2 * LIMIT)}).encode()
    refused = session.post(url, data=_chunks(too_big), timeout=30)
    assert refused.status_code == 413, refused.text
    assert str(LIMIT) in refused.json()["detail"]
    assert not Environment.objects.filter(name="big").exists()
