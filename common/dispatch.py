"""Sending a Celery task by its name, after commit: the one way any code sends one.

Services never import a tasks module (tasks import services, so that would be a circle); they
name the task, as registered with its explicit ``name=``, and this module sends it. Only Celery's
autodiscovery imports the tasks modules.

A request writes its rows, commits, then asks a worker to act. When the broker
cannot be reached at that moment the write has still happened, and the beat
sweeps pick the work up once the broker is back; so a failed send is logged and
reported as *degraded* (the response carries ``X-Portal-Degraded``, ``/readyz``
says so), never turned into a 500 for a write that committed.
"""

import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Sequence

from django.core.cache import cache
from django.db import transaction

logger = logging.getLogger(__name__)

# What failed to send during the current request; the middleware turns it into a header.
_failed_sends: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("portal_failed_sends", default=())
# When a send last failed, in the shared cache so /readyz of every web process sees it.
LAST_SEND_FAILURE_KEY = "portal:broker:last-send-failure"
# How long a failed send keeps /readyz degraded when the broker itself answers again.
SEND_FAILURE_MEMORY_S = 60


def backoff_s(retries: int, cap_s: int) -> int:
    """Exponential backoff for the next retry: 2, 4, 8 ... seconds, at most cap_s."""
    return min(2 ** (retries + 1), cap_s)


def retry_or_give_up(
    task, exc: Exception, *, give_up: Callable[[str], None], before_retry: Callable[[str], None] | None = None, cap_s: int
) -> str:
    """Retry a bound task after a transient error, or record the failure once its retries are spent."""
    if task.request.retries >= task.max_retries:
        give_up(str(exc))
        return "failed"
    if before_retry is not None:
        before_retry(str(exc))
    raise task.retry(exc=exc, countdown=backoff_s(task.request.retries, cap_s))


def _publish(name: str, args: tuple, countdown: float | None) -> None:
    from celery import current_app

    if current_app.conf.task_always_eager:
        # Eager mode (CELERY_TASK_ALWAYS_EAGER) runs the task here, which needs its function.
        current_app.loader.import_default_modules()
        current_app.tasks[name].apply_async(args=args, countdown=countdown)
        return
    current_app.send_task(name, args=args, countdown=countdown)


def _send_failed(name: str) -> None:
    _failed_sends.set((*_failed_sends.get(), name))
    try:
        cache.set(LAST_SEND_FAILURE_KEY, time.time(), SEND_FAILURE_MEMORY_S)
    except Exception:  # The cache may be the same unreachable Redis; the log line stands.
        pass


def send_task(name: str, *args, on_failure: Callable[[], None] | None = None, countdown: float | None = None) -> bool:
    """Send the task registered under ``name`` now (to run after `countdown` seconds); False (logged,
    degraded) when the broker cannot take it."""
    try:
        _publish(name, args, countdown)
    except Exception as exc:  # kombu raises OperationalError, redis ConnectionError, socket errors...
        logger.error("Could not send %s%r to the broker; the sweep will retry it: %s", name, args, exc)
        _send_failed(name)
        if on_failure is not None:
            on_failure()
        return False
    return True


# Messages per batch of `send_tasks`: one round trip to the broker each.
SEND_BATCH = 1000


def send_tasks(name: str, calls: Sequence[tuple]) -> int:
    """Send one message of the task registered under ``name`` per tuple of arguments in ``calls``, all
    at once; returns how many the broker took.

    The messages are those `send_task` sends (Celery's own, each with its id and the request's
    X-Request-ID header, added as every message is published), but they go out through one
    producer, and on Redis (kombu's publish batch) a thousand at a time in one pipeline, where one
    by one each costs a round trip: a cycle that admits a thousand jobs spent most of its time
    sending their launches. When a batch fails, its messages are sent again one by one with
    `send_task` (each failure logged and reported degraded, as there); a message of the failed
    batch may then reach the broker twice, which the tasks sent this way must bear (job_launch
    does: a second copy finds the attempt claimed or started and does nothing).
    """
    if not calls:
        return 0
    from celery import current_app

    if current_app.conf.task_always_eager:
        return sum(send_task(name, *args) for args in calls)
    sent = 0
    for start in range(0, len(calls), SEND_BATCH):
        batch = calls[start:start + SEND_BATCH]
        try:
            with current_app.producer_or_acquire() as producer:
                batched = hasattr(producer, "batch")
                grouped = producer.batch(max_size=SEND_BATCH) if batched else contextlib.nullcontext()
                # In a batch, the queue is declared once for all its messages, and no message is retried on its
                # own: the batch goes to the broker as one, and when it fails it is sent again one by one, each
                # with the retry policy (below). A fifth of the batch's time went to declaring and wrapping
                # every message for a retry of its own.
                if batched:
                    queue = current_app.amqp.router.route({}, name, (), {}, current_app.tasks.get(name)).get("queue")
                    if queue is not None:
                        producer.maybe_declare(queue)
                options = {"declare": [], "retry": False} if batched else {}
                with grouped:
                    for args in batch:
                        current_app.send_task(name, args=tuple(args), producer=producer, **options)
        except Exception as exc:  # kombu's BatchPublishError, OperationalError, redis ConnectionError...
            logger.warning("Could not send %d %s messages together (%s); sending them one by one.", len(batch), name, exc)
            sent += sum(send_task(name, *args) for args in batch)
            continue
        sent += len(batch)
    return sent


def send_task_at_most_every(window_s: float, name: str, asked_at: float, *args) -> bool:
    """A kick: ask for a run of the task registered under ``name``, a burst of asks costing at most two
    messages per ``window_s`` seconds (a shared cache key); a cache that is down sends anyway.

    The task takes the time of the ask first (``asked_at``: a run that started after it has seen
    what was asked for). The window's first ask sends at once. The first ask after it in the same
    window sends one more message, to run when the window ends, with that end as its time: the
    first message's run may already have started when a later ask came, and dropping that ask
    left its work for the beat. Later asks of the window are covered by that message.
    """
    key = f"portal:dispatch:once:{name}"
    try:
        if cache.add(key, 1, timeout=window_s):
            return send_task(name, asked_at, *args)
        if not cache.add(f"{key}:trailing", 1, timeout=window_s):
            return False
    except Exception:
        return send_task(name, asked_at, *args)
    ends_at = max(asked_at, time.time()) + window_s
    return send_task(name, ends_at, *args, countdown=window_s)


def enqueue_on_commit(name: str, *args, before_send: Callable[[], bool] | None = None,
                      on_failure: Callable[[], None] | None = None) -> None:
    """Send a task once the current transaction commits (at once outside one).

    ``before_send`` may decide, after commit, that no message is needed (a sync
    already pending); ``on_failure`` undoes what it claimed when the send fails.
    """

    def send() -> None:
        if before_send is not None and not before_send():
            return
        send_task(name, *args, on_failure=on_failure)

    send.task_name = name  # what it will send, for whoever reads the pending callbacks (tests do)
    transaction.on_commit(send)


def begin_request() -> contextvars.Token:
    return _failed_sends.set(())


def end_request(token: contextvars.Token) -> tuple[str, ...]:
    failed = _failed_sends.get()
    _failed_sends.reset(token)
    return failed


def last_send_failure() -> float | None:
    try:
        return cache.get(LAST_SEND_FAILURE_KEY)
    except Exception:
        return None
