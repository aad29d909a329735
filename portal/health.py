"""Liveness and readiness for load balancers and Kubernetes probes.

``/healthz`` answers 200 while the process serves requests. ``/readyz`` checks
the database and the broker and answers 503 with what is wrong; a broker that
refused a task recently (the write committed, the sweep will send it) shows as
``degraded`` for a minute even once the broker answers again.
"""

import time

from django.db import connection
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
    checks = {"database": _database(), "broker": _broker()}
    last = dispatch.last_send_failure()
    if last is not None:
        checks["task_sends"] = f"degraded: a task could not be sent {int(time.time() - last)} s ago; the sweeps resend it"
    ready = checks["database"] == "ok" and checks["broker"] == "ok"
    status = "ok" if ready and last is None else ("degraded" if ready or checks["database"] == "ok" else "unavailable")
    return JsonResponse({"status": status, "checks": checks}, status=200 if ready else 503)
