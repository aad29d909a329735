"""The embedded PostgreSQL and Redis (portal/embedded.py): started when no server is named, shared by
every command of the checkout, stopped by the last one to finish, and never used when a named one answers."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from django.conf import settings

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
NOBODY_DB = "postgres://postgres@127.0.0.1:9/portal"  # the discard port: nothing answers there
NOBODY_BROKER = "redis://127.0.0.1:9/0"
PRINT_URLS = "import os; print(os.environ['DATABASE_URL'], os.environ['CELERY_BROKER_URL'])"


@pytest.fixture
def checkout_env():
    # var/ outside pytest's temporary root, which stays private to root (the embedded PostgreSQL runs
    # as an unprivileged user when the tests run as root).
    var_dir = tempfile.mkdtemp(prefix="portal-embedded-var-")
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "CACHE_URL")}
    env["PORTAL_VAR_DIR"] = var_dir
    yield env
    subprocess.run([sys.executable, "-m", "portal.embedded", "stop"], cwd=REPO, env=env, timeout=60)
    shutil.rmtree(var_dir, ignore_errors=True)


def _embedded(env, *args, **kwargs):
    return subprocess.run([sys.executable, "-m", "portal.embedded", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180, **kwargs)


def _status(env) -> dict:
    return json.loads(_embedded(env, "status").stdout)


def test_exec_starts_the_embedded_servers_when_the_preferred_ones_do_not_answer_and_the_last_user_stops_them(
        checkout_env, tmp_path):
    release = tmp_path / "release"
    # A first user (a `manage.py shell`, say) that stays until told to go.
    first = subprocess.Popen(
        [sys.executable, "-m", "portal.embedded", "exec", "--prefer-database", NOBODY_DB, "--prefer-broker",
         NOBODY_BROKER, "--", sys.executable, "-c",
         f"import pathlib, time\n{PRINT_URLS}\nwhile not pathlib.Path({str(release)!r}).exists(): time.sleep(0.1)"],
        cwd=REPO, env=checkout_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    database, broker = first.stdout.readline().split()
    assert database.startswith("postgres://postgres@127.0.0.1:") and database != NOBODY_DB
    assert broker.startswith("redis://127.0.0.1:") and broker != NOBODY_BROKER
    assert _status(checkout_env) == {"root": str(Path(checkout_env["PORTAL_VAR_DIR"]).resolve() / "embedded"),
                                     "postgres": database, "redis": broker}

    # A second user while the first runs: the same servers; leaving, it stops nothing.
    second = _embedded(checkout_env, "exec", "--", sys.executable, "-c", PRINT_URLS)
    assert second.returncode == 0 and second.stdout.split() == [database, broker]
    assert _status(checkout_env)["postgres"] == database

    # The last user to leave stops both.
    release.touch()
    assert first.wait(timeout=120) == 0, first.stderr.read()
    assert _status(checkout_env)["postgres"] is None and _status(checkout_env)["redis"] is None

    # Started again, the data is still there: the database the first start created.
    again = _embedded(checkout_env, "exec", "--", sys.executable, "-c", (
        "import os, psycopg\n"
        "with psycopg.connect(os.environ['DATABASE_URL']) as c: print(c.execute('select current_database()').fetchone()[0])"))
    assert again.returncode == 0 and again.stdout.strip() == "portal", again.stderr


def test_named_servers_that_answer_are_used_and_nothing_is_started(checkout_env):
    env = {**checkout_env}
    answer = _embedded(env, "exec", "--prefer-database", settings.DATABASE_URL, "--prefer-broker",
                       settings.CELERY_BROKER_URL, "--", sys.executable, "-c", PRINT_URLS)
    assert answer.returncode == 0 and answer.stdout.split() == [settings.DATABASE_URL, settings.CELERY_BROKER_URL]
    assert not (Path(env["PORTAL_VAR_DIR"]) / "embedded" / "postgres").exists()
    # A variable already set wins over everything.
    env["DATABASE_URL"] = settings.DATABASE_URL
    answer = _embedded(env, "exec", "--prefer-database", NOBODY_DB, "--prefer-broker", settings.CELERY_BROKER_URL,
                       "--", sys.executable, "-c", PRINT_URLS)
    assert answer.stdout.split()[0] == settings.DATABASE_URL


def test_with_debug_off_nothing_is_started_and_the_settings_name_the_missing_variable(checkout_env):
    env = {**checkout_env, "DEBUG": "false", "SECRET_KEY": "x" * 60}
    answer = subprocess.run([sys.executable, "manage.py", "check"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert answer.returncode != 0 and "DATABASE_URL is not set" in answer.stderr, answer.stderr[-2000:]
    assert not (Path(env["PORTAL_VAR_DIR"]) / "embedded" / "postgres").exists()
