"""Races forced into one interleaving: a call in a thread of its own (so on a database connection of its
own), rows held locked from another connection, and the other side seen waiting on a lock in pg_stat_activity.

No process is started here: unit and integration files may use it.
"""

from __future__ import annotations

import contextlib
import threading
import time

from django.db import connection, transaction


class InThread(threading.Thread):
    """Runs fn(**kwargs) on its own database connection; outcome() joins and returns or raises."""

    def __init__(self, fn, /, **kwargs):
        super().__init__(daemon=True)
        self.fn, self.kwargs = fn, kwargs
        self.result = self.error = None
        self.start()

    def run(self):
        try:
            self.result = self.fn(**self.kwargs)
        except BaseException as exc:  # handed to the test by outcome()
            self.error = exc
        finally:
            connection.close()

    def outcome(self, timeout_s: float = 90):
        self.join(timeout_s)
        assert not self.is_alive(), f"{self.fn.__name__} did not finish in {timeout_s} s"
        if self.error is not None:
            raise self.error
        return self.result


@contextlib.contextmanager
def rows_locked(queryset, *, hold_s: float = 90):
    """Hold these rows locked (SELECT ... FOR UPDATE) from another connection while the block runs
    (``hold_s`` at the most: then the holder commits and lets them go)."""
    locked, release = threading.Event(), threading.Event()

    def hold():
        with transaction.atomic():
            list(queryset.select_for_update())
            locked.set()
            release.wait(hold_s)

    holder = InThread(hold)
    assert locked.wait(10), "could not lock the rows"
    try:
        yield
    finally:
        release.set()
        holder.outcome()


def lock_waiters() -> int:
    """Backends of this test database waiting on a lock now (this database's only: other test runs share the server)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0]


def wait_until(predicate, timeout_s: float = 30) -> bool:
    """Poll predicate() until it holds or timeout_s has passed; whether it holds at the end."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())
