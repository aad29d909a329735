"""The two cluster-wide locks, rule by rule, in this process: what waits, what skips, what is always let go.

- The beat's cycle skips while another cycle holds the lock; a kick's cycle waits, and skips
  once it has the lock if a cycle that started after the kick has committed.
- The reconcile's session-level lock is let go whatever ends the pass: an error, or the
  connection dying under it (the connection is closed then, so a kept connection never keeps it).
"""

import threading
import time

import pytest
from django.db import connection

from runners.jobs import reconcile
from runners.jobs.reconcile import RECONCILE_LOCK_KEY, jobs_reconcile_run
from runners.scheduling import services as scheduling
from runners.scheduling import tasks as scheduling_tasks
from runners.scheduling.models import SchedulerCycle
from runners.scheduling.services import CYCLE_LOCK_KEY
from tests.faults import support

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def _runs() -> int:
    return SchedulerCycle.objects.filter(id=1).values_list("runs", flat=True).first() or 0


def test_the_beats_cycle_skips_while_another_holds_the_lock_and_a_kick_waits():
    scheduling.cycle_run()
    with support.raw_connection() as other:
        other.execute("SELECT pg_advisory_xact_lock(%s)", [CYCLE_LOCK_KEY])
        beats = []
        beat = threading.Thread(target=lambda: (beats.append(scheduling_tasks.scheduler_cycle()), connection.close()),
                                daemon=True)
        beat.start()
        beat.join(5)
        assert beats == [{"skipped": "busy"}], "the beat's cycle returns at once, without waiting for the lock"
        assert _runs() == 1
        kicked_at = time.time()
        results = []
        kick = threading.Thread(target=lambda: (results.append(scheduling_tasks.scheduler_cycle(kicked_at)),
                                                connection.close()))
        kick.start()
        support.wait_for(lambda: [row for row in support.advisory_holders(CYCLE_LOCK_KEY) if not row[2]],
                         timeout_s=10, message="the kick's cycle to wait for the lock")
        other.rollback()
    kick.join(10)
    assert results and "skipped" not in results[0], results
    assert _runs() == 2
    # A kick whose cycle, once it has the lock, finds a later cycle committed does nothing more.
    assert scheduling.cycle_run(unless_ran_since=kicked_at) == {"skipped": "ran"}
    assert _runs() == 2


class _Failing:
    def __init__(self, how):
        self.how = how

    def jobs_open(self, attempts):
        self.how()


def _lock_free() -> bool:
    return not support.advisory_holders(RECONCILE_LOCK_KEY)


def test_a_reconcile_pass_that_raises_lets_go_of_its_lock(monkeypatch):
    def boom():
        raise RuntimeError("backend exploded")

    monkeypatch.setattr(reconcile, "get_backend", lambda: _Failing(boom))
    with pytest.raises(RuntimeError):
        jobs_reconcile_run()
    assert _lock_free()
    assert connection.is_usable(), "the connection stays, without the lock"
    monkeypatch.undo()
    assert "skipped" not in jobs_reconcile_run()


def test_a_reconcile_pass_whose_connection_died_leaves_no_lock_behind(monkeypatch):
    def lose_connection():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            pid = cursor.fetchone()[0]
        with support.raw_connection(autocommit=True) as other:
            other.execute("SELECT pg_terminate_backend(%s, 5000)", [pid])

    monkeypatch.setattr(reconcile, "get_backend", lambda: _Failing(lose_connection))
    with pytest.raises(Exception):
        jobs_reconcile_run()
    assert connection.connection is None, "the broken connection was closed"
    assert _lock_free()
    monkeypatch.undo()
    assert "skipped" not in jobs_reconcile_run()
