"""A request whose database connection dies mid-way answers 503 with Retry-After, wherever the query was.

The connection is really killed (``pg_terminate_backend`` from another connection) while the
request runs: in a page view, in an API view, and in a middleware (outside any view, where only
the ``got_request_exception`` mark can tell a lost connection from a bug). The next request opens
a fresh connection and succeeds.
"""

import pytest
from django.db import connection
from django.test import Client

from portal.db_errors import RETRY_AFTER_S
from runners.environments import selectors as environment_selectors
from tests.faults import support

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def _lose_the_connection() -> None:
    """Terminate this thread's database connection from another one, then use it."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    with support.raw_connection(autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s, 5000)", [pid])
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


class LosesTheConnection:
    """A middleware whose own query (outside any view) finds the connection gone."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.headers.get("X-Lose-Connection"):
            _lose_the_connection()
        return self.get_response(request)


def _assert_503(response, *, json_body: bool) -> None:
    assert response.status_code == 503, response.content[:500]
    assert response["Retry-After"] == str(RETRY_AFTER_S)
    if json_body:
        assert "connection was lost" in response.json()["detail"]


def test_a_page_view_that_loses_its_connection_answers_503(monkeypatch, owner):
    client = Client()
    client.force_login(owner)
    real = environment_selectors.environment_list

    def losing(**kwargs):
        _lose_the_connection()
        return real(**kwargs)

    monkeypatch.setattr(environment_selectors, "environment_list", losing)
    _assert_503(client.get("/"), json_body=False)
    monkeypatch.setattr(environment_selectors, "environment_list", real)
    assert client.get("/").status_code == 200


def test_an_api_view_that_loses_its_connection_answers_503_and_writes_nothing(
    monkeypatch, client_for, owner, tenant, flavors, acme_env
):
    from runners.jobs import services as jobs
    from runners.jobs.models import IdempotencyKey, Job, JobEvent
    from tests.support.jobs import give_quota

    give_quota(tenant, flavors["h100-80gb"], guaranteed=8, max=8)
    client = client_for(owner)
    real = jobs.job_submit_keyed

    def losing(**kwargs):
        job, created = real(**kwargs)  # the job's rows are written, in the view's transaction
        _lose_the_connection()
        return job, created

    monkeypatch.setattr(jobs, "job_submit_keyed", losing)
    body = support.submit_body(acme_env, "lost")
    _assert_503(client.post("/api/v1/jobs/", body, format="json", HTTP_IDEMPOTENCY_KEY="k-1"), json_body=False)
    assert not Job.objects.exists() and not JobEvent.objects.exists() and not IdempotencyKey.objects.exists(), \
        "the transaction died with the connection: nothing half-written"
    monkeypatch.setattr(jobs, "job_submit_keyed", real)
    again = client.post("/api/v1/jobs/", body, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    assert again.status_code == 201, again.content[:500]
    assert Job.objects.count() == 1


def test_a_middleware_that_loses_its_connection_answers_503(settings, owner):
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, "tests.faults.test_db_errors.LosesTheConnection"]
    client = Client(raise_request_exception=False)  # answer as a server would, not re-raise the error
    client.force_login(owner)
    _assert_503(client.get("/api/v1/jobs/", HTTP_X_LOSE_CONNECTION="1"), json_body=True)
    _assert_503(client.get("/", HTTP_X_LOSE_CONNECTION="1"), json_body=False)
    assert client.get("/api/v1/jobs/").status_code == 200
