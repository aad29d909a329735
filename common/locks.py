"""One pass at a time, cluster-wide: a session-level PostgreSQL advisory lock around a periodic pass."""

import contextlib
import logging

from django.db import connection

logger = logging.getLogger(__name__)


def _unlock(key: int, what: str) -> None:
    """Let go of the session-level lock, whatever ended the pass.

    The lock belongs to the connection, not to the transaction, and a worker keeps its connection
    between tasks (CONN_MAX_AGE): one not released would keep every other worker's pass out, and
    this one's next try would only stack a second hold on it. So when the unlock cannot be done
    (the connection broke mid-pass: it took the lock with it) or finds nothing held, the
    connection is closed, which frees every lock it had.
    """
    released = False
    with contextlib.suppress(Exception), connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
        released = bool(cursor.fetchone()[0])
    if not released:
        logger.warning("The %s lock was not released on its connection (the connection was lost mid-pass, "
                       "or the unlock failed); closing the connection.", what)
        with contextlib.suppress(Exception):
            connection.close()


@contextlib.contextmanager
def one_pass_at_a_time(key: int, what: str):
    """True while this process holds the lock named by ``key``; False when another pass holds it."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [key])
        held = cursor.fetchone()[0]
    try:
        yield held
    finally:
        if held:
            _unlock(key, what)
