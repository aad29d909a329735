"""A database connection lost mid-request answers 503 with Retry-After, never a 500.

PostgreSQL restarted, failed over, or a backend terminated (``pg_terminate_backend``, a proxy
dropping idle connections): the query under way fails with ``OperationalError`` or
``InterfaceError``, and the connection is dead. The request's transaction died with it (the
server rolls back what it never saw committed; a view's ``transaction.atomic`` block has already
unwound), so nothing is half-written, and a client that retries (with its Idempotency-Key, for a
submit) gets the right answer. So that is what the client is told: 503, ``Retry-After``, and a
JSON body under /api/.

The API's own exception handler (portal.api) answers so for what its views raise; this middleware
covers the rest: a page view (through ``process_exception``), and a query made outside any view
(the session or the user looked up by a middleware), which Django has already turned into a 500
by the time it gets here: the ``got_request_exception`` signal marks such a request, and the 500
is replaced. Either way the broken connection is closed, so the next request on this thread
opens a fresh one (with CONN_HEALTH_CHECKS, a connection that died between requests is noticed
and replaced before it is used, with no error at all).
"""

from __future__ import annotations

import contextlib
import logging
import sys

from django.core.signals import got_request_exception
from django.db import InterfaceError, OperationalError, connections
from django.http import HttpResponse

from portal.middleware import short_answer

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 2
DETAIL = "The database connection was lost while serving this request; nothing was saved by it. Try again."
_MARK = "_portal_database_lost"


def connection_lost(exc: BaseException | None) -> bool:
    """Whether this error is a database connection that broke (or could not be opened), not a bad query."""
    if not isinstance(exc, (OperationalError, InterfaceError)):
        return False
    for conn in connections.all(initialized_only=True):
        if conn.connection is None or not conn.is_usable():
            return True
    return False


def _close_broken() -> None:
    for conn in connections.all(initialized_only=True):
        if conn.connection is not None and not conn.is_usable():
            with contextlib.suppress(Exception):
                conn.close()


def unavailable(request) -> HttpResponse:
    response = short_answer(request, DETAIL, 503)
    response["Retry-After"] = str(RETRY_AFTER_S)
    return response


def _mark_request(sender, request=None, **kwargs) -> None:
    """Sent while Django turns an exception into a 500: remember when it was a lost connection."""
    if request is not None and connection_lost(sys.exc_info()[1]):
        setattr(request, _MARK, True)


got_request_exception.connect(_mark_request, dispatch_uid="portal.db_errors.mark_request")


class DatabaseUnavailableMiddleware:
    """503 with Retry-After for a request whose database connection was lost (see the module's text)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if response.status_code == 500 and getattr(request, _MARK, False):
            _close_broken()
            return unavailable(request)
        return response

    def process_exception(self, request, exception):
        if not connection_lost(exception):
            return None
        logger.warning("Database connection lost serving %s %s: %s", request.method, request.path, exception)
        _close_broken()
        return unavailable(request)
