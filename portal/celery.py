"""The Celery application; configuration comes from Django settings (CELERY_*)."""

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping

from celery import Celery
from celery.signals import beat_init, task_failure
from celery.utils.threads import bound_open_broker_sockets
from celery.worker.consumer import Consumer
from celery.worker.consumer.consumer import COLLECT_SOCKET_TIMEOUT
from django.conf import settings
from django.core.signals import setting_changed

from common.metrics import task_failed
from portal import logs  # noqa: F401  (connects the signals that carry a request's id into its tasks)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
# Django's system checks have run on these settings before any worker or beat starts: `manage.py migrate` runs
# them, in the migrate Job, in each worker pod's wait for it (`migrate --check`) and in `manage.py up`. Celery
# would run them all again in every worker and beat process, a quarter of a worker's start (about 0.3 CPU-s:
# every URL pattern and view imported to check them). CELERY_SKIP_CHECKS set empty runs them there too.
os.environ.setdefault("CELERY_SKIP_CHECKS", "1")


class CelerySettings(Mapping):
    """Django's ``CELERY_*`` settings as Celery's configuration source, read live (an override is seen at once).

    Celery looks a setting up under three spellings (``CELERY_TASK_SEND_SENT_EVENT``, ``task_send_sent_event``
    and the old name) in its source before its defaults; on Django's settings object each spelling it lacks is
    an AttributeError raised and caught, about 30 µs a lookup, and sending one task looks up six. Sending a
    cycle's 886 launch messages took a sixth less time without those misses. This source knows which names
    Django has and misses the others at once; the set is read again whenever a setting changes (Django's ``setting_changed``,
    sent by ``override_settings``).
    """

    def __init__(self) -> None:
        self._names: frozenset[str] | None = None

    @property
    def names(self) -> frozenset[str]:
        if self._names is None:
            self._names = frozenset(name for name in dir(settings) if name.startswith("CELERY_"))
        return self._names

    def forget_names(self, **kwargs) -> None:
        self._names = None

    def __getitem__(self, key: str):
        if key not in self.names:
            raise KeyError(key)
        try:
            return getattr(settings, key)
        except AttributeError:  # removed since the names were read
            raise KeyError(key) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


celery_settings = CelerySettings()
setting_changed.connect(celery_settings.forget_names, dispatch_uid="portal.celery.settings")
app = Celery("portal")
app.config_from_object(celery_settings, namespace="CELERY")
app.autodiscover_tasks()


class PortalConsumer(Consumer):
    """Celery's consumer, with a workaround for a kombu 5.7 crash when the Redis broker goes away.

    A worker notices a lost Redis on whichever of its sockets fails first. When that is the
    pub/sub one (remote control) while the consumer's BRPOP is still pending, the consumer's
    channel closes badly: its close first reads the pending BRPOP reply, that read fails too, and
    the close stops there, its unacknowledged messages not restored. Celery then lets the
    transport go and closes the channel a second time; restoring those messages now needs the
    transport's settings, gone, and ``AttributeError("'NoneType' object has no attribute
    'hostname'")`` ends the worker ("Unrecoverable error"). So the pending reply is read (or its
    read fails) first, on a bounded socket; the channel then closes in one go, while the
    transport is still there.
    """

    def on_connection_error_after_connected(self, exc):
        channel = getattr(self.connection, "_default_channel", None)
        if channel is not None and getattr(channel, "_in_poll", None):
            bound_open_broker_sockets(self.connection, COLLECT_SOCKET_TIMEOUT)
            with contextlib.suppress(Exception):  # the broker is gone: the read fails, and the BRPOP is over
                channel._brpop_read()
        super().on_connection_error_after_connected(exc)

    def ensure_connected(self, conn):
        """Connect to the broker, trying again every BROKER_RECONNECT_INTERVAL_S for as long as it takes.

        Celery's own waits grow by 2 s a try (2, 4, 6 ... up to 30 s): a worker whose broker was
        down for 13 s came back 7 s after it, behind the beat's messages sent meanwhile. (Its
        broker_connection_max_retries, 100 tries, would be under two minutes at this pace: a worker
        keeps trying instead, as the beat and the web processes do.)
        """
        ensure = conn.ensure_connection

        def steady(errback=None, max_retries=None, **kwargs):
            return ensure(errback, None, interval_start=BROKER_RECONNECT_INTERVAL_S, interval_step=0,
                          interval_max=BROKER_RECONNECT_INTERVAL_S, **kwargs)

        conn.ensure_connection = steady  # for this call only
        try:
            return super().ensure_connected(conn)
        finally:
            del conn.ensure_connection


# How often a worker that lost the broker tries it again.
BROKER_RECONNECT_INTERVAL_S = 1


app.conf.worker_consumer = f"{__name__}:PortalConsumer"


class OneLineSendErrors(logging.Filter):
    """The beat's "Message Error" (a due task it could not send) as one line: the error, no traceback.

    Celery logs the whole stack and the exception's traceback with it; rendered with its locals
    that came to thousands of lines per failed send, written while the broker was down, every
    period, by the one process that sends the periodic work.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Message Error:") and record.args:
            record.msg, record.args = "Message Error: %s (the beat sends it again next period)", (record.args[0],)
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def _one_line_send_errors(**kwargs) -> None:
    beat_logger = logging.getLogger("celery.beat")
    if not any(isinstance(existing, OneLineSendErrors) for existing in beat_logger.filters):
        beat_logger.addFilter(OneLineSendErrors())


_one_line_send_errors()
beat_init.connect(_one_line_send_errors, weak=False)  # again once logging is set up (LOGGING may replace it)


@task_failure.connect
def _count_task_failure(sender=None, **kwargs) -> None:
    """Count a task run that raised, by task name, in the store every process shares (``/metrics``).

    Connected here because every worker process loads this app; a failure is counted in the
    worker that ran the task, which the web processes serving ``/metrics`` could not see otherwise.
    """
    task_failed(getattr(sender, "name", None) or "unknown")
