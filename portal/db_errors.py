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

Before answering 503, a request whose connection died before it wrote anything is run once more,
on a fresh connection (one log line says so): a read, or a request whose writes were all in a
transaction that never committed (the server rolled it back). A write committed before the loss,
or one sent outside a transaction whose answer was lost (it may have been committed), rules the
second run out; so does a body Django would not read. The client then gets its answer, not a
503 to retry, under connections dropped every fraction of a second.
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


# Statements that write nothing; any other counts as a write (WITH too: it may hold one).
_READS = ("SELECT", "SHOW", "SET", "SAVEPOINT", "RELEASE", "ROLLBACK", "BEGIN", "START", "DECLARE", "FETCH", "CLOSE")


class _Watch:
    """Watches a request's queries (``execute_wrapper``): whether a statement found the connection
    lost, and whether anything the request wrote may have been committed before that.

    A write in autocommit mode may be committed even when its answer was lost, so it counts at
    once. A write inside a transaction counts once that transaction has ended (a later statement
    runs outside it), since it may have committed; a transaction whose statement failed on a lost
    connection never committed: the server rolled it back, so its writes do not count. (Watching
    the statements rather than asking for a commit callback leaves the transaction's own
    callbacks as the code registered them.)
    """

    def __init__(self):
        self.lost = False
        self.wrote = False
        self._writing_in: list = []  # the outermost atomic blocks that wrote and have not been seen to end

    def __call__(self, execute, sql, params, many, context):
        connection = context["connection"]
        outermost = connection.atomic_blocks[0] if connection.in_atomic_block and connection.atomic_blocks else None
        if any(block is not outermost for block in self._writing_in):
            self.wrote = True  # a transaction that wrote has ended since: it may have committed
            self._writing_in = [block for block in self._writing_in if block is outermost]
        write = not sql.lstrip(" (\n\t").upper().startswith(_READS)
        autocommitted = write and outermost is None
        if write and outermost is not None and not any(block is outermost for block in self._writing_in):
            self._writing_in.append(outermost)
        try:
            result = execute(sql, params, many, context)
        except (OperationalError, InterfaceError):
            # An autocommitted write whose answer was lost may have been committed all the same.
            self.wrote = self.wrote or autocommitted
            if not self.lost and not self.wrote and (connection.connection is None or not connection.is_usable()):
                self.lost = True
            raise
        if autocommitted and context["cursor"].rowcount != 0:  # (an UPDATE that matched no row wrote nothing)
            self.wrote = True
        return result

    @property
    def retry_safe(self) -> bool:
        return self.lost and not self.wrote


def _keep_body(request) -> bool:
    """Read the body now (bounded by BodySizeLimitMiddleware), so that a second run can read it again."""
    try:
        request.body  # noqa: B018
    except Exception:  # a body Django will not read: the view answers for it, and there is no second run
        return False
    return True


class DatabaseUnavailableMiddleware:
    """503 with Retry-After for a request whose database connection was lost (see the module's text),
    after one more run on a fresh connection when the connection died before the request had
    written anything (a read, or a write whose transaction never committed)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        replayable = _keep_body(request)
        watch = _Watch()
        with contextlib.ExitStack() as stack:
            for conn in connections.all():
                stack.enter_context(conn.execute_wrapper(watch))
            response = self.get_response(request)
        if response.status_code in (500, 503) and replayable and watch.retry_safe:
            logger.warning("Database connection lost serving %s %s before it wrote anything; running it again "
                           "on a fresh connection", request.method, request.path)
            _close_broken()
            if hasattr(request, _MARK):
                delattr(request, _MARK)
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
