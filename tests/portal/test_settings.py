"""Settings come from the environment; a malformed value stops start-up naming it."""

import os
import secrets
import subprocess
import sys

import pytest

from tests.conftest import REPO


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
        ("CELERY_BROKER_URL", "kafka://x", "must be redis://"),
        ("CELERY_VISIBILITY_TIMEOUT_S", "soon", "is not a whole number"),
        ("STUCK_AFTER_S", "0", "must be at least 1"),
        ("KUBERNETES_USERNAME_TEMPLATE", "oidc:", "must contain {username}"),
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


@pytest.mark.django_db
def test_the_openapi_schema_and_docs_are_served(client):
    schema = client.get("/api/schema/")
    assert schema.status_code == 200
    text = schema.content.decode()
    for path in ("/api/v1/environments/", "/api/v1/tenants/{tenant_slug}/members/", "/api/v1/auth/token/"):
        assert path in text
    assert client.get("/api/docs/").status_code == 200
