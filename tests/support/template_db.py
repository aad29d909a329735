"""Each pytest process's test database is a copy of one migrated template, not a migration of its own.

Migrating an empty database through every app's migrations costs a pytest process 8-10 s of CPU before
its first test, and `make test` starts three of them (a developer's single-file run pays it too). Instead,
the migrations are run once into a template database named after a hash of every installed app's
migration files and Django's version (`portal_template_<hash>`); each process then copies it with
PostgreSQL's `CREATE DATABASE ... TEMPLATE`, which copies files and takes well under a second. A changed
or added migration changes the hash, so a stale template is never used; templates of other hashes are
dropped when a new one is built (one that is in use at that moment is left for the next build).

After the copy, pytest-django's usual setup runs with keepdb, so Django still checks the copy is fully
migrated (a no-op migrate) exactly as it would its own database.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import django
import psycopg
from django.apps import apps
from django.conf import settings
from django.db import connection
from psycopg import sql

REPO = Path(__file__).resolve().parent.parent.parent
TEMPLATE_PREFIX = "portal_template_"
# One template build at a time across every pytest process on this server (xdist's and other checkouts').
LOCK_KEY = 7_360_101


def migrations_fingerprint() -> str:
    """A hash of every installed app's migration files (names and contents) and Django's version."""
    digest = hashlib.sha256(django.get_version().encode())
    for app in sorted(apps.get_app_configs(), key=lambda config: config.label):
        folder = Path(app.path) / "migrations"
        for path in sorted(folder.glob("*.py")) if folder.is_dir() else []:
            digest.update(f"{app.label}/{path.name}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _url(database: dict, name: str) -> str:
    password = f":{database['PASSWORD']}" if database.get("PASSWORD") else ""
    return f"postgres://{database['USER']}{password}@{database['HOST']}:{database['PORT'] or 5432}/{name}"


def _admin_connection(database: dict) -> psycopg.Connection:
    """A connection to the server's maintenance database, where databases are created and dropped."""
    return psycopg.connect(
        dbname="postgres", user=database["USER"], password=database.get("PASSWORD") or None,
        host=database["HOST"], port=database["PORT"] or 5432, autocommit=True,
    )


def _exists(admin: psycopg.Connection, name: str) -> bool:
    return admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone() is not None


def _build_template(admin: psycopg.Connection, database: dict, template: str) -> None:
    building = f"{template}_building"
    admin.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(building)))
    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(building)))
    env = {**os.environ, "DATABASE_URL": _url(database, building)}
    env.pop("TEST_DATABASE_NAME", None)
    done = subprocess.run([sys.executable, "manage.py", "migrate", "--no-input", "-v", "0"], cwd=REPO, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(building)))
        raise RuntimeError(f"Migrating the test template failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    admin.execute(sql.SQL("ALTER DATABASE {} RENAME TO {}").format(sql.Identifier(building), sql.Identifier(template)))
    # Nobody works in the template itself: a connection to it would make every copy fail.
    admin.execute(sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(sql.Identifier(template)))
    stale = admin.execute("SELECT datname FROM pg_database WHERE datname LIKE %s AND datname <> %s",
                          [f"{TEMPLATE_PREFIX}%", template]).fetchall()
    for (name,) in stale:
        try:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        except psycopg.Error:
            pass  # Being copied by another run right now: the next build drops it.


def copy_test_database() -> str:
    """Make this process's test database a fresh copy of the migrated template; return its name."""
    name = connection.creation._get_test_db_name()
    copy_of_template(name)
    return name


def copy_of_template(name: str) -> None:
    """Database ``name`` (dropped first if it exists) as a copy of the migrated template, built if missing."""
    database = settings.DATABASES["default"]
    template = TEMPLATE_PREFIX + migrations_fingerprint()[:16]
    with _admin_connection(database) as admin:
        admin.execute("SELECT pg_advisory_lock(%s)", [LOCK_KEY])
        try:
            if not _exists(admin, template):
                _build_template(admin, database, template)
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
            admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name),
                                                                           sql.Identifier(template)))
        finally:
            admin.execute("SELECT pg_advisory_unlock(%s)", [LOCK_KEY])


def drop_test_database(name: str) -> None:
    """At the end of the run: this process's own database, whatever connection a server thread still holds."""
    with _admin_connection(settings.DATABASES["default"]) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
