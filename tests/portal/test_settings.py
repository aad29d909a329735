"""Settings come from the environment; a malformed value stops start-up naming it."""

import os
import secrets
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def _manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("DEBUG", "SECRET_KEY", "ALLOWED_HOSTS")}
    environment.update(env)
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=REPO, env=environment, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("name", "value", "phrase"),
    [
        ("DEBUG", "maybe", "is not a boolean"),
        ("CLUSTER_BACKEND", "nomad", "is not one of: local, kubernetes"),
        ("DATABASE_URL", "mysql://x", "must be a URL starting with"),
        ("CELERY_BROKER_URL", "kafka://x", "must be a URL starting with one of: redis://, rediss://"),
        ("CACHE_URL", "memcached://x", "must be a URL starting with one of: redis://, rediss://"),
        ("CELERY_VISIBILITY_TIMEOUT_S", "soon", "is not a whole number"),
        ("STUCK_AFTER_S", "0", "must be at least 1"),
        ("KUBERNETES_USERNAME_TEMPLATE", "oidc:", "must contain {username}"),
        ("LOG_FORMAT", "xml", "is not one of: json, plain"),
        ("REQUEST_MAX_BODY_BYTES", "100", "must be at least 1024"),
        ("API_PAGE_SIZE", "500", "must be at most 200"),
        ("SENTRY_TRACES_SAMPLE_RATE", "2", "must be between 0 and 1"),
        ("DEFRAG_BUDGET", "5", "must be at most 1"),
        ("DEFRAG_BUDGET", "-0.1", "must be at least 0"),
        ("DEFRAG_MOVE_COST_S", "lots", "is not a number"),
    ],
)
def test_a_malformed_variable_stops_start_up_naming_it(name, value, phrase):
    result = _manage("check", **{name: value})
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert name in last_line and phrase in last_line, result.stderr[-2000:]


def test_debug_off_requires_a_secret_key():
    result = _manage("check", DEBUG="false")
    assert result.returncode != 0
    assert "SECRET_KEY must be set when DEBUG is off" in result.stderr


def test_check_deploy_with_production_settings_prints_no_warning():
    result = _manage(
        "check", "--deploy", "--fail-level", "WARNING",
        DEBUG="false", SECRET_KEY=secrets.token_urlsafe(50), ALLOWED_HOSTS="portal.example.com",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNINGS" not in result.stdout + result.stderr
    assert "System check identified no issues (0 silenced)." in result.stdout


def test_the_api_body_bound_may_not_exceed_the_request_bound():
    result = _manage("check", API_MAX_BODY_BYTES="4096", REQUEST_MAX_BODY_BYTES="2048")
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert "API_MAX_BODY_BYTES=4096 is over REQUEST_MAX_BODY_BYTES=2048" in last_line, result.stderr[-2000:]


PRINT_SETTINGS = (
    "from django.conf import settings as s; import json; print(json.dumps({name: getattr(s, name) for name in ["
    "'SESSION_COOKIE_SECURE', 'SESSION_COOKIE_HTTPONLY', 'SESSION_COOKIE_SAMESITE', 'CSRF_COOKIE_SECURE', "
    "'CSRF_COOKIE_HTTPONLY', 'CSRF_COOKIE_SAMESITE', 'LOG_FORMAT', 'REQUEST_MAX_BODY_BYTES', 'API_MAX_BODY_BYTES', "
    "'DATA_UPLOAD_MAX_MEMORY_SIZE', 'FILE_UPLOAD_MAX_MEMORY_SIZE', 'DATA_UPLOAD_MAX_NUMBER_FIELDS', "
    "'WHITENOISE_USE_FINDERS', 'WHITENOISE_AUTOREFRESH', 'SENTRY_DSN', 'MIDDLEWARE']}))"
)


def _settings(**env: str) -> dict:
    import json

    # Empty is unset: what this machine's environment says of these must not change the defaults read here.
    result = _manage("shell", "-c", PRINT_SETTINGS, **{"LOG_FORMAT": "", "SENTRY_DSN": "", **env})
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_production_settings_harden_cookies_and_bound_every_request():
    values = _settings(DEBUG="false", SECRET_KEY=secrets.token_urlsafe(50), ALLOWED_HOSTS="portal.example.com",
                       REQUEST_MAX_BODY_BYTES="2097152", REQUEST_MAX_FIELDS="300")
    assert values["SESSION_COOKIE_SECURE"] and values["CSRF_COOKIE_SECURE"]
    assert values["SESSION_COOKIE_HTTPONLY"] and values["CSRF_COOKIE_HTTPONLY"]
    assert values["SESSION_COOKIE_SAMESITE"] == values["CSRF_COOKIE_SAMESITE"] == "Lax"
    assert values["LOG_FORMAT"] == "json", "JSON lines unless LOG_FORMAT says otherwise"
    assert values["REQUEST_MAX_BODY_BYTES"] == values["DATA_UPLOAD_MAX_MEMORY_SIZE"] == 2097152
    assert values["FILE_UPLOAD_MAX_MEMORY_SIZE"] == 2097152 and values["DATA_UPLOAD_MAX_NUMBER_FIELDS"] == 300
    assert not values["WHITENOISE_USE_FINDERS"] and not values["WHITENOISE_AUTOREFRESH"]
    middleware = values["MIDDLEWARE"]
    assert middleware[:2] == ["portal.middleware.RequestIdMiddleware", "portal.middleware.BodySizeLimitMiddleware"]
    security = middleware.index("django.middleware.security.SecurityMiddleware")
    assert middleware[security + 1] == "whitenoise.middleware.WhiteNoiseMiddleware"


def test_local_settings_serve_static_files_from_the_apps_and_log_plain_lines():
    values = _settings(DEBUG="true")
    assert values["LOG_FORMAT"] == "plain"
    assert values["WHITENOISE_USE_FINDERS"] and values["WHITENOISE_AUTOREFRESH"]
    assert "whitenoise.middleware.WhiteNoiseMiddleware" in values["MIDDLEWARE"]
    assert values["REQUEST_MAX_BODY_BYTES"] == values["API_MAX_BODY_BYTES"]
    assert values["SENTRY_DSN"] == ""


@pytest.mark.django_db
def test_the_openapi_schema_and_docs_are_served(client):
    schema = client.get("/api/schema/")
    assert schema.status_code == 200
    text = schema.content.decode()
    for path in ("/api/v1/environments/", "/api/v1/tenants/{tenant_slug}/members/", "/api/v1/auth/token/"):
        assert path in text
    assert client.get("/api/docs/").status_code == 200
