"""Liveness and readiness for load balancers and Kubernetes probes.

``/healthz`` answers 200 while the process serves requests. ``/readyz`` checks
the database (reachable, every migration applied) and the broker and answers
503 with what is wrong; a broker that
refused a task recently (the write committed, the sweep will send it) shows as
``degraded`` for a minute even once the broker answers again.
"""

import time

from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.migrations.executor import MigrationExecutor
from django.http import JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from common import dispatch


@never_cache
@require_GET
def healthz(request):
    return JsonResponse({"status": "ok"})


def _database() -> str:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return "ok"
    except Exception as exc:
        return f"unreachable: {exc}"


# Once every migration is applied it stays so for this process's life (a deploy that adds one starts new
# processes), so the answer is kept and the check costs nothing after that.
_migrated = False


def _migrations() -> str:
    global _migrated
    if _migrated:
        return "ok"
    try:
        executor = MigrationExecutor(connections[DEFAULT_DB_ALIAS])
        plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    except Exception as exc:
        return f"unknown: {exc}"
    if plan:
        names = [f"{migration.app_label}.{migration.name}" for migration, backwards in plan if not backwards]
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        return f"not applied: {len(plan)} migration(s) ({shown}); run `manage.py migrate`"
    _migrated = True
    return "ok"


def _broker() -> str:
    from portal.celery import app

    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
        return "ok"
    except Exception as exc:
        return f"unreachable: {exc}"


@never_cache
@require_GET
def readyz(request):
    checks = {"database": _database()}
    checks["migrations"] = _migrations() if checks["database"] == "ok" else "unknown: the database is unreachable"
    checks["broker"] = _broker()
    last = dispatch.last_send_failure()
    if last is not None:
        checks["task_sends"] = f"degraded: a task could not be sent {int(time.time() - last)} s ago; the sweeps resend it"
    ready = checks["database"] == "ok" and checks["migrations"] == "ok" and checks["broker"] == "ok"
    database_usable = checks["database"] == "ok" and checks["migrations"] == "ok"
    status = "ok" if ready and last is None else ("degraded" if ready or database_usable else "unavailable")
    return JsonResponse({"status": status, "checks": checks}, status=200 if ready else 503)
